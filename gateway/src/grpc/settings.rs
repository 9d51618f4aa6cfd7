//! `sbx.v1.SettingService`: adapters over the front door's settings
//! ([`crate::frontdoor`]), which checks every call against the sandbox's workspace.

use sbx_proto::v1::setting_service_server::SettingService;
use sbx_proto::v1::{
    DeleteSettingRequest, DeleteSettingResponse, GetSettingRequest, ListSettingsRequest,
    ListSettingsResponse, SetSettingsRequest, SetSettingsResponse, Setting,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::sandboxes::selector;
use super::status::failed;
use crate::auth;

#[tonic::async_trait]
impl SettingService for SbxService {
    async fn set_settings(
        &self,
        request: Request<SetSettingsRequest>,
    ) -> Result<Response<SetSettingsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let settings = self.front.set_settings(&caller, &sel, req.values).await;
        let settings = settings.map_err(failed)?;
        Ok(Response::new(SetSettingsResponse { settings }))
    }

    async fn get_setting(
        &self,
        request: Request<GetSettingRequest>,
    ) -> Result<Response<Setting>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let setting = self.front.get_setting(&caller, &sel, &req.key).await;
        setting.map(Response::new).map_err(failed)
    }

    async fn list_settings(
        &self,
        request: Request<ListSettingsRequest>,
    ) -> Result<Response<ListSettingsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let page = self
            .front
            .list_settings(&caller, &sel, req.page_size, &req.page_token)
            .await
            .map_err(failed)?;
        Ok(Response::new(ListSettingsResponse {
            settings: page.items,
            next_page_token: page.next_page_token,
        }))
    }

    async fn delete_setting(
        &self,
        request: Request<DeleteSettingRequest>,
    ) -> Result<Response<DeleteSettingResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let deleted = self.front.delete_setting(&caller, &sel, &req.key).await;
        let deleted = deleted.map_err(failed)?;
        Ok(Response::new(DeleteSettingResponse { deleted }))
    }
}
