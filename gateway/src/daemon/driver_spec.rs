//! The value of `sbxd serve --driver`: where the compute driver runs.
//!
//! - a driver's name from the registry (`oci`, `process`, `sim`, `vm`): in sbxd's own process;
//! - `remote:SOCKET`: served by an `sbxd driver` (or `sbx-driver-host`) the operator runs;
//! - `managed:NAME` for every name in the registry: served by an `sbxd driver` that sbxd
//!   starts and supervises itself (see [`super::managed`]).
//!
//! Naming: the driver is registered in the actors' DriverSet under its backend's name
//! ("oci", "process", "sim" or "vm"), which is what each sandbox's `spec.driver` records. A remote driver's
//! backend is not known to sbxd, so it is named by `--driver-name`, default "process": a data
//! dir's sandboxes keep working when sbxd switches between `process`, `managed:process` and
//! `remote:SOCKET` over the same process state dir (a remote vm driver is `--driver-name vm`).

use std::fmt;
use std::path::PathBuf;

use super::DriverKind;

/// Where the compute driver runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverSpec {
    /// In sbxd's own process.
    InProcess(DriverKind),
    /// Served on this Unix socket by a driver host someone else runs.
    Remote(PathBuf),
    /// Served by a driver host sbxd runs and supervises.
    Managed(DriverKind),
}

/// The name a remote driver gets when `--driver-name` is not given.
pub const DEFAULT_REMOTE_DRIVER_NAME: &str = "process";

impl DriverSpec {
    /// The name the driver is registered under: the backend's, or for a remote driver
    /// `name_flag` (default [`DEFAULT_REMOTE_DRIVER_NAME`]).
    pub fn driver_name(&self, name_flag: Option<&str>) -> Result<String, String> {
        match (self, name_flag) {
            (DriverSpec::Remote(_), Some(name)) => {
                sbx_proto::names::validate_name(name).map_err(|e| e.to_string())?;
                Ok(name.to_string())
            }
            (DriverSpec::Remote(_), None) => Ok(DEFAULT_REMOTE_DRIVER_NAME.to_string()),
            (_, Some(_)) => Err(
                "only a remote driver (--driver remote:SOCKET) can be renamed; in-process and \
                 managed drivers are named after their backend"
                    .to_string(),
            ),
            (DriverSpec::InProcess(kind) | DriverSpec::Managed(kind), None) => {
                Ok(kind.name().to_string())
            }
        }
    }
}

impl fmt::Display for DriverSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverSpec::InProcess(kind) => f.write_str(kind.name()),
            DriverSpec::Remote(socket) => write!(f, "remote:{}", socket.display()),
            DriverSpec::Managed(kind) => write!(f, "managed:{}", kind.name()),
        }
    }
}

/// What `--driver` may be: every driver of the registry, in process or managed, or remote.
fn expected() -> String {
    let names = sbx_drivers::registry::names(", ");
    let managed = sbx_drivers::registry::names("|");
    format!("expected {names}, remote:SOCKET or managed:{managed}")
}

/// Parses a `--driver` value (clap's value parser).
pub fn parse_driver_spec(text: &str) -> Result<DriverSpec, String> {
    let backend = |name: &str| {
        DriverKind::named(name)
            .ok_or_else(|| format!("unknown driver backend {name:?}; {}", expected()))
    };
    match text.split_once(':') {
        None => backend(text).map(DriverSpec::InProcess),
        Some(("remote", "")) => Err(format!(
            "remote: needs the driver's Unix socket path, e.g. remote:/run/sbx/process.sock; \
             {}",
            expected()
        )),
        Some(("remote", socket)) => Ok(DriverSpec::Remote(PathBuf::from(socket))),
        Some(("managed", "")) => Err(format!("managed: needs a backend; {}", expected())),
        Some(("managed", name)) => backend(name).map(DriverSpec::Managed),
        Some((kind, _)) => Err(format!("unknown driver kind {kind:?}; {}", expected())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(
            parse_driver_spec("process"),
            Ok(DriverSpec::InProcess(DriverKind::named("process").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("sim"),
            Ok(DriverSpec::InProcess(DriverKind::named("sim").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("remote:/run/a:b.sock"),
            Ok(DriverSpec::Remote(PathBuf::from("/run/a:b.sock")))
        );
        assert_eq!(
            parse_driver_spec("managed:process"),
            Ok(DriverSpec::Managed(DriverKind::named("process").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("managed:sim"),
            Ok(DriverSpec::Managed(DriverKind::named("sim").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("vm"),
            Ok(DriverSpec::InProcess(DriverKind::named("vm").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("managed:vm"),
            Ok(DriverSpec::Managed(DriverKind::named("vm").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("oci"),
            Ok(DriverSpec::InProcess(DriverKind::named("oci").unwrap()))
        );
        assert_eq!(
            parse_driver_spec("managed:oci"),
            Ok(DriverSpec::Managed(DriverKind::named("oci").unwrap()))
        );
    }

    #[test]
    fn bad_values_say_what_is_expected() {
        for (bad, mentions) in [
            ("remote:", "socket"),
            ("remote", "\"remote\""),
            ("managed:", "backend"),
            ("managed:docker", "\"docker\""),
            ("vm:", "\"vm\""),
            ("VM", "\"VM\""),
            ("ssh:host", "\"ssh\""),
            ("", "\"\""),
        ] {
            let err = parse_driver_spec(bad).unwrap_err();
            assert!(err.contains(mentions), "{bad:?}: {err}");
            assert!(err.contains("remote:SOCKET"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn names_default_to_the_backend_and_remote_to_process() {
        let remote = DriverSpec::Remote(PathBuf::from("/s"));
        assert_eq!(remote.driver_name(None).unwrap(), "process");
        assert_eq!(remote.driver_name(Some("sim")).unwrap(), "sim");
        assert!(remote.driver_name(Some("Bad_Name")).is_err());
        let managed = DriverSpec::Managed(DriverKind::named("sim").unwrap());
        assert_eq!(managed.driver_name(None).unwrap(), "sim");
        assert!(managed.driver_name(Some("x")).is_err());
        let vm = DriverSpec::Managed(DriverKind::named("vm").unwrap());
        assert_eq!(vm.driver_name(None).unwrap(), "vm");
        assert_eq!(remote.driver_name(Some("vm")).unwrap(), "vm");
        assert_eq!(
            DriverSpec::InProcess(DriverKind::named("process").unwrap())
                .driver_name(None)
                .unwrap(),
            "process"
        );
    }

    #[test]
    fn display_round_trips() {
        for text in [
            "process",
            "sim",
            "vm",
            "remote:/a/b.sock",
            "managed:process",
            "managed:vm",
            "oci",
            "managed:oci",
        ] {
            assert_eq!(parse_driver_spec(text).unwrap().to_string(), text);
        }
    }
}
