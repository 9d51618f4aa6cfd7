//! The sim's tiny built-in command set for `exec`, run against a sandbox's in-memory `/sandbox`.
//!
//! - `echo ARGS…` writes the arguments joined by spaces and a newline to stdout, exit 0;
//! - `exit [N]` exits N (0 when absent);
//! - `cat FILE` writes the file's contents to stdout; `cat` alone, with stdin, writes back
//!   what it reads until stdin ends, then exits 0 ([`cat_stdin`]); without stdin (empty, as
//!   `/dev/null` for real drivers) it writes nothing and exits 0;
//! - `write FILE TEXT…` stores TEXT (the arguments joined by spaces, no newline added) in FILE;
//! - anything else writes `sim: unknown command: NAME` to stderr and exits 127.
//!
//! FILE is `/sandbox/…` or a path relative to `/sandbox`; other paths are refused with exit 1,
//! since `/sandbox` is the only storage that persists.

use std::collections::BTreeMap;

use futures::StreamExt;

use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, pb};

/// `cat` on stdin: each stdin chunk back as stdout, in order; the exit (0) once stdin ends
/// (its close, or the end of the input stream). Signal 9 or 15 ends it as killed by it.
pub(crate) fn cat_stdin(input: ExecInputStream) -> DriverStream<pb::ExecOutput> {
    use pb::exec_input::Input;
    use pb::exec_output::Chunk;
    let out = |chunk| Ok::<_, DriverError>(pb::ExecOutput { chunk: Some(chunk) });
    let stream = futures::stream::unfold(Some(input), move |state| async move {
        let mut input = state?;
        loop {
            let exit = |signal| {
                let code = if signal == 0 { 0 } else { -1 };
                Some((
                    out(Chunk::Exit(pb::ExecExit {
                        code,
                        signal,
                        timed_out: false,
                    })),
                    None,
                ))
            };
            match input.next().await.and_then(|m| m.input) {
                Some(Input::Stdin(bytes)) => return Some((out(Chunk::Stdout(bytes)), Some(input))),
                Some(Input::CloseStdin(true)) | None => return exit(0),
                Some(Input::Signal(n @ (9 | 15))) => return exit(n),
                Some(_) => {}
            }
        }
    });
    Box::pin(stream)
}

/// What a built-in command produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExecResult {
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: Vec<u8>,
    pub(crate) code: i32,
}

impl ExecResult {
    fn ok(stdout: impl Into<Vec<u8>>) -> Self {
        ExecResult {
            stdout: stdout.into(),
            stderr: Vec::new(),
            code: 0,
        }
    }

    fn failed(code: i32, stderr: impl Into<String>) -> Self {
        let mut stderr = stderr.into();
        stderr.push('\n');
        ExecResult {
            stdout: Vec::new(),
            stderr: stderr.into_bytes(),
            code,
        }
    }
}

/// The absolute path under `/sandbox` that `path` names, or `None` when it is outside it.
fn sandbox_path(path: &str) -> Option<String> {
    let absolute = if let Some(rest) = path.strip_prefix("/sandbox/") {
        rest
    } else if path.starts_with('/') {
        return None;
    } else {
        path
    };
    let parts: Vec<&str> = absolute
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.is_empty() || parts.contains(&"..") {
        return None;
    }
    Some(format!("/sandbox/{}", parts.join("/")))
}

/// Runs `argv` (non-empty; the caller refuses an empty command) against `files`.
pub(crate) fn run_builtin(argv: &[String], files: &mut BTreeMap<String, String>) -> ExecResult {
    let Some((name, args)) = argv.split_first() else {
        return ExecResult::failed(127, "sim: unknown command: (empty)");
    };
    match name.as_str() {
        "echo" => ExecResult::ok(format!("{}\n", args.join(" "))),
        "exit" => match args {
            [] => ExecResult::ok(Vec::new()),
            [code] => match code.parse::<i32>() {
                Ok(code) => ExecResult {
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                    code,
                },
                Err(_) => {
                    ExecResult::failed(2, format!("sim: exit: {code}: numeric argument required"))
                }
            },
            _ => ExecResult::failed(2, "sim: exit: too many arguments"),
        },
        "cat" => match args {
            [file] => match sandbox_path(file) {
                None => ExecResult::failed(1, format!("cat: {file}: outside /sandbox")),
                Some(path) => match files.get(&path) {
                    Some(contents) => ExecResult::ok(contents.clone()),
                    None => {
                        ExecResult::failed(1, format!("cat: {file}: No such file or directory"))
                    }
                },
            },
            [] => ExecResult::ok(Vec::new()),
            _ => ExecResult::failed(2, "usage: cat FILE"),
        },
        "write" => match args {
            [file, text @ ..] => match sandbox_path(file) {
                None => ExecResult::failed(1, format!("write: {file}: outside /sandbox")),
                Some(path) => {
                    files.insert(path, text.join(" "));
                    ExecResult::ok(Vec::new())
                }
            },
            [] => ExecResult::failed(2, "usage: write FILE TEXT..."),
        },
        other => ExecResult::failed(127, format!("sim: unknown command: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    /// Runs `words` on `files` and compares stdout, stderr and the exit code.
    fn check(
        files: &mut BTreeMap<String, String>,
        words: &[&str],
        stdout: &str,
        stderr: &str,
        code: i32,
    ) {
        let got = run_builtin(&argv(words), files);
        let want = ExecResult {
            stdout: stdout.as_bytes().to_vec(),
            stderr: stderr.as_bytes().to_vec(),
            code,
        };
        assert_eq!(got, want, "command {words:?}");
    }

    #[test]
    fn builtins() {
        let mut files = BTreeMap::new();
        check(&mut files, &["echo", "hello"], "hello\n", "", 0);
        check(&mut files, &["echo", "a", "b"], "a b\n", "", 0);
        check(&mut files, &["echo"], "\n", "", 0);
        // `cat` without stdin reads an empty one.
        check(&mut files, &["cat"], "", "", 0);
        check(&mut files, &["exit", "3"], "", "", 3);
        check(&mut files, &["exit"], "", "", 0);
        check(
            &mut files,
            &["exit", "x"],
            "",
            "sim: exit: x: numeric argument required\n",
            2,
        );
        check(&mut files, &["ls"], "", "sim: unknown command: ls\n", 127);
        check(
            &mut files,
            &["sh", "-c", "exit 3"],
            "",
            "sim: unknown command: sh\n",
            127,
        );
        check(&mut files, &[], "", "sim: unknown command: (empty)\n", 127);
    }

    #[test]
    fn files_live_under_sandbox_only() {
        let mut files = BTreeMap::new();
        check(
            &mut files,
            &["cat", "/sandbox/a"],
            "",
            "cat: /sandbox/a: No such file or directory\n",
            1,
        );
        check(
            &mut files,
            &["write", "/sandbox/a", "one", "two"],
            "",
            "",
            0,
        );
        check(&mut files, &["cat", "/sandbox/a"], "one two", "", 0);
        // A relative path names the same file.
        check(&mut files, &["cat", "a"], "one two", "", 0);
        check(&mut files, &["write", "dir/b", "x"], "", "", 0);
        check(&mut files, &["cat", "/sandbox/dir/b"], "x", "", 0);
        check(
            &mut files,
            &["write", "/tmp/c", "x"],
            "",
            "write: /tmp/c: outside /sandbox\n",
            1,
        );
        check(
            &mut files,
            &["cat", "/sandbox/../etc"],
            "",
            "cat: /sandbox/../etc: outside /sandbox\n",
            1,
        );
        check(
            &mut files,
            &["write", "/sandbox/"],
            "",
            "write: /sandbox/: outside /sandbox\n",
            1,
        );
        assert_eq!(
            files.keys().cloned().collect::<Vec<_>>(),
            vec!["/sandbox/a".to_string(), "/sandbox/dir/b".to_string()]
        );
    }
}
