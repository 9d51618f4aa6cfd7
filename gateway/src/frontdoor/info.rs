//! What the gateway is: its version, its default driver, and each driver with what it can do
//! (or why it cannot say). Open to every authenticated caller.

use sbx_proto::v1::{DriverInfo, GatewayInfo};

use super::FrontDoor;

impl FrontDoor {
    /// The gateway's version and drivers.
    pub async fn gateway_info(&self) -> GatewayInfo {
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
        GatewayInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            default_driver,
            drivers,
        }
    }
}
