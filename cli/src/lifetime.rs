//! Lifetimes, as two nouns share them: the flags of `sbx sandbox create` and `sbx workspace
//! lifetime set` (`--ttl/--on-ttl/--idle-timeout/--on-idle/--delete-after`, …), a lifetime and
//! a duration in words, and the lines a lifetime and the next deadline add to `sbx sandbox
//! get`. The commands are the nouns': `sbx sandbox ttl` (`cmd/sandbox/lifecycle.rs`) and `sbx
//! workspace lifetime get|set` (`cmd/workspace/lifetime.rs`).

use clap::{Args, ValueEnum};
use sbx_proto::v1::{Lifetime, LifetimeAction, Sandbox};
use serde::Serialize;

use super::CliError;

/// What a deadline does, as the flags name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ActionArg {
    /// Delete the sandbox and its files.
    Delete,
    /// Stop the workload; its files are kept.
    Stop,
    /// Save the workload's processes and memory to disk (drivers that can pause: vm).
    Pause,
}

impl From<ActionArg> for LifetimeAction {
    fn from(a: ActionArg) -> Self {
        match a {
            ActionArg::Delete => LifetimeAction::Delete,
            ActionArg::Stop => LifetimeAction::Stop,
            ActionArg::Pause => LifetimeAction::Pause,
        }
    }
}

/// The lifetime flags of `sbx sandbox create` and `sbx workspace lifetime set`.
#[derive(Debug, Clone, Default, Args)]
pub struct LifetimeFlags {
    /// A deadline this long after creation (30s, 10m, 2h, 7d): then --on-ttl happens. `sbx
    /// sandbox ttl` moves it. (--timeout is how long create waits for Ready.)
    #[arg(long, value_name = "DURATION", value_parser = super::size::parse_lifetime,
          allow_hyphen_values = true)]
    pub ttl: Option<u64>,
    /// What the ttl does: delete (the default), stop or pause.
    #[arg(long = "on-ttl", value_enum, value_name = "ACTION")]
    pub on_ttl: Option<ActionArg>,
    /// Stop or pause the sandbox once it has been idle this long: no exec, cp, port-forward,
    /// log follow or routed request, and its workload under the gateway's --idle-cpu.
    #[arg(long = "idle-timeout", value_name = "DURATION", value_parser = super::size::parse_lifetime,
          allow_hyphen_values = true)]
    pub idle_timeout: Option<u64>,
    /// What idleness does: stop (the default) or pause.
    #[arg(long = "on-idle", value_enum, value_name = "ACTION")]
    pub on_idle: Option<ActionArg>,
    /// Delete the sandbox once it has been Stopped, Completed or ended in Error by itself
    /// (a non-zero exit) this long.
    #[arg(long = "delete-after", value_name = "DURATION", value_parser = super::size::parse_lifetime,
          allow_hyphen_values = true)]
    pub delete_after: Option<u64>,
    /// A use (exec, cp, port-forward, routed request) of a paused sandbox resumes it first.
    /// Default: when a deadline paused it, not when `sbx sandbox pause` did.
    #[arg(long = "auto-resume", conflicts_with = "no_auto_resume")]
    pub auto_resume: bool,
    /// A use of a paused sandbox is refused until `sbx sandbox resume`.
    #[arg(long = "no-auto-resume")]
    pub no_auto_resume: bool,
    /// A request routed to one of the sandbox's service endpoints (which nobody
    /// authenticates) may wake it when its idle timeout paused it; never when its ttl or `sbx
    /// sandbox pause` did, and a wake leaves the ttl where it was. Off by default: a
    /// stranger's request wakes nothing.
    #[arg(long = "wake-on-request")]
    pub wake_on_request: bool,
}

impl LifetimeFlags {
    /// The lifetime the flags say, or `None` when none was given.
    pub fn lifetime(&self) -> Result<Option<Lifetime>, CliError> {
        let given = self.ttl.is_some()
            || self.on_ttl.is_some()
            || self.idle_timeout.is_some()
            || self.on_idle.is_some()
            || self.delete_after.is_some()
            || self.auto_resume
            || self.no_auto_resume
            || self.wake_on_request;
        if !given {
            return Ok(None);
        }
        if self.on_ttl.is_some() && self.ttl.is_none() {
            return Err(CliError::Usage("--on-ttl needs --ttl DURATION".into()));
        }
        if self.on_idle.is_some() && self.idle_timeout.is_none() {
            return Err(CliError::Usage(
                "--on-idle needs --idle-timeout DURATION".into(),
            ));
        }
        if self.on_idle == Some(ActionArg::Delete) {
            return Err(CliError::Usage(
                "--on-idle takes stop or pause; to delete a stopped sandbox, give --delete-after"
                    .into(),
            ));
        }
        Ok(Some(Lifetime {
            ttl_seconds: self.ttl.unwrap_or(0),
            on_ttl: self.on_ttl.map_or(LifetimeAction::Unspecified, Into::into) as i32,
            idle_timeout_seconds: self.idle_timeout.unwrap_or(0),
            on_idle: self.on_idle.map_or(LifetimeAction::Unspecified, Into::into) as i32,
            delete_after_seconds: self.delete_after.unwrap_or(0),
            auto_resume: if self.auto_resume {
                Some(true)
            } else if self.no_auto_resume {
                Some(false)
            } else {
                None
            },
            wake_on_request: self.wake_on_request,
        }))
    }
}

/// A duration as people write it: `90s`, `10m`, `2h`, `3d`, `1h30m`.
pub fn duration(secs: u64) -> String {
    if secs == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    let mut left = secs;
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if left >= size {
            out.push_str(&format!("{}{unit}", left / size));
            left %= size;
        }
    }
    out
}

fn action_name(a: LifetimeAction, default: &str) -> String {
    match a {
        LifetimeAction::Unspecified => default.to_string(),
        other => other.as_str_name()["LIFETIME_ACTION_".len()..].to_ascii_lowercase(),
    }
}

/// A lifetime in words: `ttl 10m (delete), idle 5m (stop), delete after 1h, auto-resume`;
/// `none` when it says nothing.
pub fn lifetime_text(l: &Lifetime) -> String {
    let mut parts = Vec::new();
    if l.ttl_seconds > 0 {
        parts.push(format!(
            "ttl {} ({})",
            duration(l.ttl_seconds),
            action_name(l.on_ttl(), "delete")
        ));
    }
    if l.idle_timeout_seconds > 0 {
        parts.push(format!(
            "idle {} ({})",
            duration(l.idle_timeout_seconds),
            action_name(l.on_idle(), "stop")
        ));
    }
    if l.delete_after_seconds > 0 {
        parts.push(format!("delete after {}", duration(l.delete_after_seconds)));
    }
    match l.auto_resume {
        Some(true) => parts.push("auto-resume".into()),
        Some(false) => parts.push("no auto-resume".into()),
        None => {}
    }
    if l.wake_on_request {
        parts.push("wakes on request".into());
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// The lines `sbx sandbox get` adds for a sandbox with a lifetime: what it is, and what the
/// gateway does next (`NEXT: stop at 2026-12-04T16:00:00Z (Idle)`).
pub fn sandbox_lines(sb: &Sandbox) -> String {
    let mut out = String::new();
    if let Some(l) = sb.spec.as_ref().and_then(|s| s.lifetime.as_ref()) {
        out.push_str(&format!("LIFETIME: {}\n", lifetime_text(l)));
    }
    if let Some(next) = &sb.next {
        out.push_str(&format!(
            "NEXT: {} at {} ({})\n",
            next.action,
            super::output::rfc3339(next.at.as_ref()).unwrap_or_else(|| "-".into()),
            next.reason
        ));
    }
    out
}

/// A lifetime as JSON/YAML shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LifetimeView {
    pub ttl_seconds: u64,
    pub on_ttl: String,
    pub idle_timeout_seconds: u64,
    pub on_idle: String,
    pub delete_after_seconds: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
}

pub fn lifetime_view(l: &Lifetime) -> LifetimeView {
    LifetimeView {
        ttl_seconds: l.ttl_seconds,
        on_ttl: action_name(l.on_ttl(), "delete"),
        idle_timeout_seconds: l.idle_timeout_seconds,
        on_idle: action_name(l.on_idle(), "stop"),
        delete_after_seconds: l.delete_after_seconds,
        auto_resume: l.auto_resume,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_lifetimes_read_as_people_write_them() {
        assert_eq!(duration(0), "0s");
        assert_eq!(duration(90), "1m30s");
        assert_eq!(duration(3 * 86_400 + 3600), "3d1h");
        assert_eq!(lifetime_text(&Lifetime::default()), "none");
        assert_eq!(
            lifetime_text(&Lifetime {
                ttl_seconds: 600,
                idle_timeout_seconds: 300,
                on_idle: LifetimeAction::Pause as i32,
                delete_after_seconds: 3600,
                auto_resume: Some(false),
                ..Default::default()
            }),
            "ttl 10m (delete), idle 5m (pause), delete after 1h, no auto-resume"
        );
    }

    #[test]
    fn flags_make_a_lifetime_or_say_what_is_missing() {
        assert_eq!(LifetimeFlags::default().lifetime().unwrap(), None);
        let l = LifetimeFlags {
            ttl: Some(600),
            on_ttl: Some(ActionArg::Pause),
            auto_resume: true,
            ..Default::default()
        }
        .lifetime()
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.ttl_seconds, l.on_ttl(), l.auto_resume),
            (600, LifetimeAction::Pause, Some(true))
        );
        for bad in [
            LifetimeFlags {
                on_ttl: Some(ActionArg::Stop),
                ..Default::default()
            },
            LifetimeFlags {
                on_idle: Some(ActionArg::Stop),
                ..Default::default()
            },
            LifetimeFlags {
                idle_timeout: Some(5),
                on_idle: Some(ActionArg::Delete),
                ..Default::default()
            },
        ] {
            assert!(matches!(bad.lifetime(), Err(CliError::Usage(_))), "{bad:?}");
        }
    }
}
