//! `sbx.v1.GatewayService`: what the gateway is (its version, its drivers and what each can
//! do), an adapter over the front door's [`gateway_info`](crate::frontdoor::FrontDoor::gateway_info).

use sbx_proto::v1::gateway_service_server::GatewayService;
use sbx_proto::v1::{GatewayInfo, GetGatewayInfoRequest};
use tonic::{Request, Response, Status};

use super::SbxService;

#[tonic::async_trait]
impl GatewayService for SbxService {
    async fn get_gateway_info(
        &self,
        _: Request<GetGatewayInfoRequest>,
    ) -> Result<Response<GatewayInfo>, Status> {
        Ok(Response::new(self.front.gateway_info().await))
    }
}
