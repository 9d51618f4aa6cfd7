//! The local terminal for `sbx sandbox exec -t`: whether stdin is one, its size, and raw mode.
//!
//! With `-i -t` the local terminal is put into raw mode, so every key (Ctrl-C as byte 0x03,
//! Ctrl-D as 0x04, arrows as escape sequences) goes to the remote pty unchanged and the remote
//! side does the echo and line editing, as with `docker exec -it` and `kubectl exec -it`. A
//! terminal left raw is unusable (no echo, no line editing), so [`RawMode`] restores the saved
//! settings when it drops — on a normal end, on an error (before it is printed: the guard lives
//! inside the exec, the error is printed by the caller), and on a panic (its hook restores
//! before the panic message is written). Signals that would end `sbx` (SIGTERM, SIGHUP) are
//! caught by the exec loop and forwarded, so they end it through the same drop.
//!
//! rustix (already the agent's terminal crate) gives safe `tcgetattr`/`tcsetattr`/
//! `tcgetwinsize`; the workspace forbids unsafe code, so no raw ioctls.

use std::io::IsTerminal;

use rustix::termios::{OptionalActions, Termios, tcgetattr, tcgetwinsize, tcsetattr};
use sbx_proto::v1::{TerminalSize, Tty};

/// The terminal type sent when `TERM` is unset or empty (what the agent assumes for "" too).
const DEFAULT_TERM: &str = "xterm";

/// Whether the CLI's stdin is a terminal (`-t` needs one).
pub fn stdin_is_terminal() -> bool {
    std::io::stdin().is_terminal()
}

/// The size of the terminal on stdin, or None when it has none (not a terminal, or a pty
/// whose size was never set: 0×0).
pub fn stdin_size() -> Option<TerminalSize> {
    let size = tcgetwinsize(std::io::stdin()).ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then(|| TerminalSize {
        rows: u32::from(size.ws_row),
        cols: u32::from(size.ws_col),
    })
}

/// What `-t` asks for: the local terminal's size (0×0 lets the agent choose when unknown) and
/// `TERM` (default "xterm").
pub fn tty_request(term: Option<String>) -> Tty {
    let size = stdin_size().unwrap_or_default();
    Tty {
        rows: size.rows,
        cols: size.cols,
        term: term
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_TERM.to_string()),
    }
}

/// The local terminal in raw mode; the settings it had are put back on drop (and by the panic
/// hook installed while it lives).
#[derive(Debug)]
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Saves stdin's terminal settings and makes it raw.
    pub fn enter() -> std::io::Result<RawMode> {
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin)?;
        let mut raw = saved.clone();
        raw.make_raw();
        // A panic prints its message before unwinding reaches the guard: restore first, so the
        // message (and the shell after it) see a sane terminal.
        let for_hook = saved.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore(&for_hook);
            previous(info);
        }));
        tcsetattr(&stdin, OptionalActions::Now, &raw)?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore(&self.saved);
    }
}

/// Puts `saved` back on stdin, at once (`Now`, not `Drain`: draining waits for the terminal
/// to take all output, which never ends when its reader is stuck). Nothing to do on failure:
/// the terminal is gone.
fn restore(saved: &Termios) {
    let _ = tcsetattr(std::io::stdin(), OptionalActions::Now, saved);
}
