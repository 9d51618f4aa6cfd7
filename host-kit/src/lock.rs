//! One live driver instance per state directory, and mutexes that survive a panic.
//!
//! Two live instances on one state would launch and kill the same workloads, so `open` takes
//! an exclusive `flock` on `<state_dir>/driver.lock`. The kernel releases it when the holder's
//! process dies, so a killed driver never leaves a stale lock behind; a new instance waits up
//! to [`INSTANCE_LOCK_WAIT`] for a previous one (in the same process, being dropped) to let go.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::internal;
use sbx_driver_api::DriverError;

/// How long `open` waits for a previous instance on the same state to let go.
const INSTANCE_LOCK_WAIT: Duration = Duration::from_secs(2);

/// Takes the exclusive lock on `<state_dir>/driver.lock`, waiting up to
/// [`INSTANCE_LOCK_WAIT`]; `Unavailable` if another instance holds it.
pub fn lock_state_dir(state_dir: &Path) -> Result<Flock<File>, DriverError> {
    let path = state_dir.join("driver.lock");
    let mut file = File::create(&path)
        .map_err(|e| internal(&format!("opening the driver lock {}", path.display()), e))?;
    let deadline = Instant::now() + INSTANCE_LOCK_WAIT;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                file = back;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err((_, Errno::EWOULDBLOCK)) => {
                return Err(DriverError::Unavailable(format!(
                    "another driver instance holds {}",
                    path.display()
                )));
            }
            Err((_, e)) => {
                return Err(internal(
                    &format!("locking the state directory {}", state_dir.display()),
                    e,
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_instance_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_state_dir(dir.path()).unwrap();
        let started = Instant::now();
        let err = lock_state_dir(dir.path()).unwrap_err();
        assert!(matches!(err, DriverError::Unavailable(_)), "{err:?}");
        assert!(err.to_string().contains("driver.lock"), "{err}");
        assert!(started.elapsed() >= INSTANCE_LOCK_WAIT, "gave up too soon");
        drop(first);
        lock_state_dir(dir.path()).unwrap();
    }
}
