//! Checks of a workload's command and environment, before they reach a launch or an exec:
//! what the kernel's `execve` would refuse (NUL bytes) or misread (a variable named with `=`)
//! is refused up front as an invalid argument that names it.

use sbx_driver_api::DriverError;

/// Checks a command and its environment before they reach a launch or `exec`: no empty command, no NUL
/// bytes, no empty variable names or names with `=`.
pub fn validate_command<'a>(
    what: &str,
    command: &[String],
    env: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<(), DriverError> {
    let invalid = |why: String| Err(DriverError::InvalidArgument(format!("{what}: {why}")));
    if command.is_empty() {
        return invalid("the command is empty".to_string());
    }
    if let Some(arg) = command.iter().find(|a| a.contains('\0')) {
        return invalid(format!("argument {arg:?} holds a NUL byte"));
    }
    for (key, value) in env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return invalid(format!("environment variable {key:?} is not valid"));
        }
    }
    Ok(())
}

/// What a start or a create adds to the spec's environment for one run (credentials,
/// settings): kept in memory and handed to the workload only, never written to a record.
pub type RunEnv = std::collections::BTreeMap<String, String>;

/// A request's `run_env`, its names checked like the spec's (an error names the variable,
/// never its value).
pub fn run_env(env: std::collections::HashMap<String, String>) -> Result<RunEnv, DriverError> {
    for (key, value) in &env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(DriverError::InvalidArgument(format!(
                "the run's environment: variable {key:?} is not valid"
            )));
        }
    }
    Ok(env.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn commands_and_environments_are_checked() {
        let cmd = |args: &[&str]| args.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let env = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        let ok =
            |c: &[&str], e: HashMap<String, String>| validate_command("t", &cmd(c), &e).is_ok();
        assert!(ok(&["sleep", "1"], env("A", "b=c")));
        assert!(!ok(&[], env("A", "1")));
        assert!(!ok(&["a\0b"], env("A", "1")));
        assert!(!ok(&["true"], env("", "1")));
        assert!(!ok(&["true"], env("A=B", "1")));
        assert!(!ok(&["true"], env("A", "x\0")));
    }
}
