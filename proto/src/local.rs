//! Where a gateway on this machine keeps its state by default, and so where its Unix socket
//! is: `sbxd` makes them there, and a client with no endpoint given looks there.

use std::path::PathBuf;

/// Where root's state lives by default (the oci driver's sandboxes must walk through the
/// data dir's parents, which /root does not let them).
pub const ROOT_DATA_DIR: &str = "/var/lib/sbx";

/// The gateway's Unix socket, in its data dir.
pub const SOCKET_NAME: &str = "sbxd.sock";

/// The default data directory of a process whose effective user is root (`root`) or not:
/// /var/lib/sbx for root, else $XDG_STATE_HOME/sbx, else ~/.local/state/sbx; `None` when
/// neither variable is set (an empty one counts as unset).
pub fn default_data_dir(root: bool) -> Option<PathBuf> {
    resolve_data_dir(
        root,
        std::env::var_os("XDG_STATE_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

/// [`default_data_dir`] without the environment, for tests.
fn resolve_data_dir(
    root: bool,
    xdg_state_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> Option<PathBuf> {
    if root {
        return Some(PathBuf::from(ROOT_DATA_DIR));
    }
    if let Some(xdg) = xdg_state_home.filter(|p| !p.as_os_str().is_empty()) {
        return Some(xdg.join("sbx"));
    }
    home.filter(|p| !p.as_os_str().is_empty())
        .map(|home| home.join(".local").join("state").join("sbx"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_dir_precedence() {
        let xdg = Some(PathBuf::from("/xdg"));
        let home = Some(PathBuf::from("/home/u"));
        assert_eq!(
            resolve_data_dir(true, xdg.clone(), home.clone()).unwrap(),
            PathBuf::from(ROOT_DATA_DIR)
        );
        assert_eq!(
            resolve_data_dir(false, xdg, home.clone()).unwrap(),
            PathBuf::from("/xdg/sbx")
        );
        assert_eq!(
            resolve_data_dir(false, Some(PathBuf::new()), home.clone()).unwrap(),
            PathBuf::from("/home/u/.local/state/sbx")
        );
        assert_eq!(resolve_data_dir(false, None, Some(PathBuf::new())), None);
        assert_eq!(resolve_data_dir(false, None, None), None);
    }
}
