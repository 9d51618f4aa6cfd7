//! One `ComputeDriver` for every host driver: [`HostService`] is what a driver answers its own
//! way (capabilities, exec, copies, port forwarding, usage), and
//! [`host_compute_driver!`](crate::host_compute_driver) writes the contract's impl from it, the
//! driver's create and the kit. Create, start, stop and delete run detached
//! ([`crate::lifecycle::detach`]), so a caller that gives up cannot cut one short; get, list,
//! watch and logs are the kit's; a networked driver's policy updates and status are
//! [`crate::sandbox_network`]'s.

use async_trait::async_trait;
use sbx_driver_api::pb;
use sbx_driver_api::{ByteStream, DriverError, DriverStream, ExecInputStream, ForwardInputStream};

/// What a host driver answers its own way, besides its create (see
/// [`host_compute_driver!`](crate::host_compute_driver)).
#[async_trait]
pub trait HostService: Send + Sync + 'static {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError>;

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError>;

    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError>;

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError>;

    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError>;

    /// What the sandbox uses now, from the host's accounting ([`crate::usage`]).
    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError>;
}

/// The `ComputeDriver` impl of a host driver `$driver`, a [`HostService`] with the fields
/// `inner: Arc<I>` (`I`: [`HostDriver`](crate::HostDriver), the driver's state) and `alive:
/// Alive`; `$create` is its create, `async fn(&Arc<I>, pb::CreateRequest) -> Result<Snapshot,
/// DriverError>`. Start, stop, delete and create run detached
/// ([`lifecycle::detach`](crate::lifecycle::detach)), the reads are the kit's. With
/// `networked`, a sandbox's network policy is updated and read through
/// [`crate::sandbox_network`] (`I` has `records` of
/// [`NetworkedRecord`](crate::sandbox_network::NetworkedRecord)s and `opts.network`); without,
/// the contract's defaults say the driver has no network. It expands in the driver's own
/// crate, so the state stays private there.
#[macro_export]
macro_rules! host_compute_driver {
    ($driver:ty, create = $create:path) => {
        $crate::host_compute_driver!(@impl $driver, $create {});
    };
    ($driver:ty, create = $create:path, networked) => {
        $crate::host_compute_driver!(@impl $driver, $create {
            async fn update_network(
                &self,
                req: ::sbx_driver_api::pb::UpdateNetworkRequest,
            ) -> Result<::sbx_driver_api::pb::NetworkStatus, ::sbx_driver_api::DriverError> {
                let inner = ::std::sync::Arc::clone(&self.inner);
                $crate::lifecycle::detach(async move {
                    let network = inner.opts.network.as_ref();
                    $crate::sandbox_network::update(&inner.records, network, req).await
                })
                .await
            }

            async fn get_network(
                &self,
                req: ::sbx_driver_api::pb::GetNetworkRequest,
            ) -> Result<::sbx_driver_api::pb::NetworkStatus, ::sbx_driver_api::DriverError> {
                let network = self.inner.opts.network.as_ref();
                $crate::sandbox_network::get(&self.inner.records, network, req).await
            }
        });
    };
    (@impl $driver:ty, $create:path { $($network:tt)* }) => {
        #[::async_trait::async_trait]
        impl ::sbx_driver_api::ComputeDriver for $driver {
            async fn capabilities(
                &self,
            ) -> Result<::sbx_driver_api::pb::CapabilitiesResponse, ::sbx_driver_api::DriverError>
            {
                <$driver as $crate::service::HostService>::capabilities(self).await
            }

            async fn create(
                &self,
                req: ::sbx_driver_api::pb::CreateRequest,
            ) -> Result<::sbx_driver_api::pb::Snapshot, ::sbx_driver_api::DriverError> {
                let inner = ::std::sync::Arc::clone(&self.inner);
                $crate::lifecycle::detach(async move { $create(&inner, req).await }).await
            }

            async fn start(
                &self,
                req: ::sbx_driver_api::pb::StartRequest,
            ) -> Result<::sbx_driver_api::pb::Snapshot, ::sbx_driver_api::DriverError> {
                let inner = ::std::sync::Arc::clone(&self.inner);
                $crate::lifecycle::detach(async move {
                    $crate::lifecycle::start(inner.as_ref(), req).await
                })
                .await
            }

            async fn stop(
                &self,
                req: ::sbx_driver_api::pb::StopRequest,
            ) -> Result<::sbx_driver_api::pb::Snapshot, ::sbx_driver_api::DriverError> {
                let inner = ::std::sync::Arc::clone(&self.inner);
                $crate::lifecycle::detach(async move {
                    $crate::lifecycle::stop(inner.as_ref(), req).await
                })
                .await
            }

            async fn delete(
                &self,
                req: ::sbx_driver_api::pb::DeleteRequest,
            ) -> Result<::sbx_driver_api::pb::DeleteResponse, ::sbx_driver_api::DriverError> {
                let inner = ::std::sync::Arc::clone(&self.inner);
                $crate::lifecycle::detach(async move {
                    $crate::lifecycle::delete(inner.as_ref(), req).await
                })
                .await
            }

            async fn get(
                &self,
                req: ::sbx_driver_api::pb::GetRequest,
            ) -> Result<::sbx_driver_api::pb::Snapshot, ::sbx_driver_api::DriverError> {
                $crate::lifecycle::get(self.inner.as_ref(), &req)
            }

            async fn list(
                &self,
            ) -> Result<Vec<::sbx_driver_api::pb::Snapshot>, ::sbx_driver_api::DriverError> {
                Ok($crate::lifecycle::list(self.inner.as_ref()))
            }

            async fn watch(
                &self,
            ) -> Result<
                ::sbx_driver_api::DriverStream<::sbx_driver_api::pb::WatchEvent>,
                ::sbx_driver_api::DriverError,
            > {
                Ok($crate::lifecycle::watch(&self.inner, &self.alive))
            }

            async fn exec_io(
                &self,
                req: ::sbx_driver_api::pb::ExecRequest,
                input: ::sbx_driver_api::ExecInputStream,
            ) -> Result<
                ::sbx_driver_api::DriverStream<::sbx_driver_api::pb::ExecOutput>,
                ::sbx_driver_api::DriverError,
            > {
                <$driver as $crate::service::HostService>::exec_io(self, req, input).await
            }

            async fn logs(
                &self,
                req: ::sbx_driver_api::pb::LogsRequest,
            ) -> Result<
                ::sbx_driver_api::DriverStream<::sbx_driver_api::pb::LogChunk>,
                ::sbx_driver_api::DriverError,
            > {
                $crate::lifecycle::logs(&self.inner, &req, &self.alive)
            }

            async fn copy_from(
                &self,
                req: ::sbx_driver_api::pb::CopyFromRequest,
            ) -> Result<
                ::sbx_driver_api::DriverStream<::sbx_driver_api::pb::CopyChunk>,
                ::sbx_driver_api::DriverError,
            > {
                <$driver as $crate::service::HostService>::copy_from(self, req).await
            }

            async fn copy_to(
                &self,
                req: ::sbx_driver_api::pb::CopyToStart,
                data: ::sbx_driver_api::ByteStream,
            ) -> Result<::sbx_driver_api::pb::CopyToResponse, ::sbx_driver_api::DriverError> {
                <$driver as $crate::service::HostService>::copy_to(self, req, data).await
            }

            async fn port_forward(
                &self,
                req: ::sbx_driver_api::pb::PortForwardStart,
                input: ::sbx_driver_api::ForwardInputStream,
            ) -> Result<
                ::sbx_driver_api::DriverStream<::sbx_driver_api::pb::PortForwardOutput>,
                ::sbx_driver_api::DriverError,
            > {
                <$driver as $crate::service::HostService>::port_forward(self, req, input).await
            }

            async fn stats(
                &self,
                req: ::sbx_driver_api::pb::StatsRequest,
            ) -> Result<::sbx_driver_api::pb::SandboxUsage, ::sbx_driver_api::DriverError> {
                <$driver as $crate::service::HostService>::stats(self, req).await
            }

            $($network)*
        }
    };
}
