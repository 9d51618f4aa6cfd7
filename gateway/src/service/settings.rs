//! `sbx.v1.SettingService` over the actor API: settings are the sandbox's, so every call is
//! checked against the sandbox's workspace (viewer to read, editor to set or delete).

use sbx_proto::v1::setting_service_server::SettingService;
use sbx_proto::v1::{
    DeleteSettingRequest, DeleteSettingResponse, GetSettingRequest, ListSettingsRequest,
    ListSettingsResponse, SetSettingsRequest, SetSettingsResponse, Setting,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::access::{audit, error_for};
use super::sandboxes::{describe, selector};
use crate::auth::{self, Role};

#[tonic::async_trait]
impl SettingService for SbxService {
    async fn set_settings(
        &self,
        request: Request<SetSettingsRequest>,
    ) -> Result<Response<SetSettingsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "set settings", &describe(&sel));
        let settings = self
            .gateway
            .set_settings(&sel, req.values)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(SetSettingsResponse { settings }))
    }

    async fn get_setting(
        &self,
        request: Request<GetSettingRequest>,
    ) -> Result<Response<Setting>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        self.gateway
            .get_setting(&sel, &req.key)
            .await
            .map(Response::new)
            .map_err(|e| error_for(&caller, e))
    }

    async fn list_settings(
        &self,
        request: Request<ListSettingsRequest>,
    ) -> Result<Response<ListSettingsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let page = self
            .gateway
            .list_settings(&sel, req.page_size, &req.page_token)
            .await
            .map_err(|e| error_for(&caller, e))?;
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
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "delete setting", &describe(&sel));
        let deleted = self
            .gateway
            .delete_setting(&sel, &req.key)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DeleteSettingResponse { deleted }))
    }
}
