//! `sbx.v1.GatewayService`: what the gateway is (its version, its drivers and what each can do).

use sbx_proto::v1::gateway_service_server::GatewayService;
use sbx_proto::v1::{DriverInfo, GatewayInfo, GetGatewayInfoRequest};
use tonic::{Request, Response, Status};

use super::SbxService;

#[tonic::async_trait]
impl GatewayService for SbxService {
    async fn get_gateway_info(
        &self,
        _: Request<GetGatewayInfoRequest>,
    ) -> Result<Response<GatewayInfo>, Status> {
        let (default_driver, drivers) = self.gateway.drivers_info().await;
        let drivers = drivers
            .into_iter()
            .map(|(name, caps)| match caps {
                Ok(c) => DriverInfo {
                    name,
                    kind: c.driver,
                    version: c.version,
                    isolation: c.isolation,
                    exec_stdin: c.exec_stdin,
                    exec_tty: c.exec_tty,
                    copy: c.copy,
                    port_forward: c.port_forward,
                    copy_when_stopped: c.copy_when_stopped,
                    pause: c.pause,
                    images: c.images,
                    error: String::new(),
                },
                Err(error) => DriverInfo {
                    name,
                    error,
                    ..Default::default()
                },
            })
            .collect();
        Ok(Response::new(GatewayInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            default_driver,
            drivers,
        }))
    }
}
