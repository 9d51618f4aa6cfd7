//! A Dockerfile as the steps a build runs. The text is parsed by `parse-dockerfile` (line
//! continuations, comments, parser directives, JSON and shell forms, here-documents); this
//! module turns its instructions into [`Step`]s, refuses what the builder does not do with a
//! message naming the line, and expands `$VAR`/`${VAR}` as Docker does ([`expand`]).

use std::collections::BTreeMap;

use parse_dockerfile::{Command, Instruction};

use super::{BuildError, Result};

/// The largest Dockerfile taken.
pub const MAX_DOCKERFILE: usize = 1 << 20;
/// The most instructions one Dockerfile may hold.
pub const MAX_STEPS: usize = 1000;

/// One instruction, its words still unexpanded (ENV and ARG change what they expand to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    From(String),
    /// Shell form: the command line, run by the current SHELL; exec form: the argv.
    Run(Form),
    Copy {
        sources: Vec<String>,
        dest: String,
        chown: Option<String>,
        chmod: Option<String>,
        /// ADD: its sources are checked again once expanded ([`refuse_add_source`]).
        add: bool,
    },
    Env(String),
    Arg(String),
    Workdir(String),
    User(String),
    Entrypoint(Form),
    Cmd(Form),
    Label(String),
    Expose(Vec<String>),
    Shell(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Form {
    Shell(String),
    Exec(Vec<String>),
}

impl Form {
    /// The argv: a shell form run by `shell`.
    pub fn argv(&self, shell: &[String]) -> Vec<String> {
        match self {
            Form::Shell(line) => shell.iter().cloned().chain([line.clone()]).collect(),
            Form::Exec(argv) => argv.clone(),
        }
    }
}

/// A step and the line it came from (1-based), and its text as written (for progress).
#[derive(Debug, Clone)]
pub struct Parsed {
    pub step: Step,
    pub line: usize,
    pub text: String,
}

fn refuse(line: usize, why: impl std::fmt::Display) -> BuildError {
    BuildError::Invalid(format!("Dockerfile line {line}: {why}"))
}

/// The steps of `text`: one FROM first (ARGs before it are global), then the rest.
pub fn parse(text: &str) -> Result<Vec<Parsed>> {
    if text.len() > MAX_DOCKERFILE {
        return Err(BuildError::Invalid(format!(
            "the Dockerfile is {} bytes; at most {MAX_DOCKERFILE} are taken",
            text.len()
        )));
    }
    let file = parse_dockerfile::parse(text)
        .map_err(|e| BuildError::Invalid(format!("the Dockerfile does not parse: {e}")))?;
    if file.instructions.len() > MAX_STEPS {
        return Err(BuildError::Invalid(format!(
            "the Dockerfile has {} instructions; at most {MAX_STEPS} are taken",
            file.instructions.len()
        )));
    }
    let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut froms = 0;
    for ins in &file.instructions {
        let span = span_of(ins);
        let line = line_of(span.start);
        // As one line: continuations joined, runs of blanks made one.
        let text = text[span]
            .replace("\\\n", " ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let step = match ins {
            Instruction::From(f) => {
                froms += 1;
                if froms > 1 {
                    return Err(refuse(
                        line,
                        "a second FROM: multi-stage builds are not supported; build each stage \
                         as its own image",
                    ));
                }
                if let Some(flag) = f.options.first() {
                    return Err(refuse(
                        line,
                        format!("FROM --{} is not supported", flag.name.value),
                    ));
                }
                Step::From(f.image.value.to_string())
            }
            Instruction::Run(r) => {
                if let Some(flag) = r.options.first() {
                    return Err(refuse(
                        line,
                        format!(
                            "RUN --{} is not supported (network: `sbx image build --allow`)",
                            flag.name.value
                        ),
                    ));
                }
                if !r.here_docs.is_empty() {
                    return Err(refuse(line, "RUN with a here-document is not supported"));
                }
                Step::Run(form(&r.arguments))
            }
            Instruction::Copy(c) => copy_step(line, "COPY", &c.options, &c.src, &c.dest)?,
            Instruction::Add(a) => {
                for src in &a.src {
                    if let parse_dockerfile::Source::Path(p) = src {
                        refuse_add_source(line, &p.value)?;
                    }
                }
                match copy_step(line, "ADD", &a.options, &a.src, &a.dest)? {
                    Step::Copy {
                        sources,
                        dest,
                        chown,
                        chmod,
                        ..
                    } => Step::Copy {
                        sources,
                        dest,
                        chown,
                        chmod,
                        add: true,
                    },
                    other => other,
                }
            }
            Instruction::Env(e) => {
                // Its form is checked now, before anything runs (values expand later).
                let pairs =
                    pairs(&e.arguments.value, &BTreeMap::new(), true).map_err(|e| match e {
                        BuildError::Invalid(m) => refuse(line, m),
                        e => e,
                    })?;
                if let Some((k, _)) = pairs.iter().find(|(_, v)| v.is_none()) {
                    return Err(refuse(line, format!("ENV {k} has no value")));
                }
                Step::Env(e.arguments.value.to_string())
            }
            Instruction::Arg(a) => Step::Arg(a.arguments.value.to_string()),
            Instruction::Workdir(w) => Step::Workdir(w.arguments.value.to_string()),
            Instruction::User(u) => Step::User(u.arguments.value.to_string()),
            Instruction::Entrypoint(e) => Step::Entrypoint(form(&e.arguments)),
            Instruction::Cmd(c) => Step::Cmd(form(&c.arguments)),
            Instruction::Label(l) => Step::Label(l.arguments.value.to_string()),
            Instruction::Maintainer(m) => {
                Step::Label(format!("maintainer={}", quote(&m.name.value)))
            }
            Instruction::Expose(e) => {
                Step::Expose(e.arguments.iter().map(|a| a.value.to_string()).collect())
            }
            Instruction::Shell(s) if s.arguments.is_empty() => {
                return Err(refuse(
                    line,
                    "SHELL needs a JSON array, such as [\"/bin/bash\", \"-c\"]",
                ));
            }
            Instruction::Shell(s) => {
                Step::Shell(s.arguments.iter().map(|a| a.value.to_string()).collect())
            }
            Instruction::Healthcheck(_) => {
                return Err(refuse(line, "HEALTHCHECK is not supported"));
            }
            Instruction::Onbuild(_) => return Err(refuse(line, "ONBUILD is not supported")),
            Instruction::Stopsignal(_) => return Err(refuse(line, "STOPSIGNAL is not supported")),
            Instruction::Volume(_) => {
                return Err(refuse(
                    line,
                    "VOLUME is not supported (a sandbox's volume is /sandbox)",
                ));
            }
            #[allow(unreachable_patterns)]
            _ => return Err(refuse(line, "an instruction this builder does not know")),
        };
        if froms == 0 && !matches!(step, Step::Arg(_) | Step::From(_)) {
            return Err(refuse(line, "only ARG may come before FROM"));
        }
        out.push(Parsed { step, line, text });
    }
    if froms == 0 {
        return Err(BuildError::Invalid("the Dockerfile has no FROM".into()));
    }
    Ok(out)
}

fn span_of(ins: &Instruction<'_>) -> std::ops::Range<usize> {
    let start = match ins {
        Instruction::Add(i) => i.add.span.start,
        Instruction::Arg(i) => i.arg.span.start,
        Instruction::Cmd(i) => i.cmd.span.start,
        Instruction::Copy(i) => i.copy.span.start,
        Instruction::Entrypoint(i) => i.entrypoint.span.start,
        Instruction::Env(i) => i.env.span.start,
        Instruction::Expose(i) => i.expose.span.start,
        Instruction::From(i) => i.from.span.start,
        Instruction::Healthcheck(i) => i.healthcheck.span.start,
        Instruction::Label(i) => i.label.span.start,
        Instruction::Maintainer(i) => i.maintainer.span.start,
        Instruction::Onbuild(i) => i.onbuild.span.start,
        Instruction::Run(i) => i.run.span.start,
        Instruction::Shell(i) => i.shell.span.start,
        Instruction::Stopsignal(i) => i.stopsignal.span.start,
        Instruction::User(i) => i.user.span.start,
        Instruction::Volume(i) => i.volume.span.start,
        Instruction::Workdir(i) => i.workdir.span.start,
        #[allow(unreachable_patterns)]
        _ => 0,
    };
    let end = match ins {
        Instruction::Add(i) => i.dest.span.end,
        Instruction::Arg(i) => i.arguments.span.end,
        Instruction::Cmd(i) => command_end(&i.arguments),
        Instruction::Entrypoint(i) => command_end(&i.arguments),
        Instruction::Copy(i) => i.dest.span.end,
        Instruction::Env(i) => i.arguments.span.end,
        Instruction::Expose(i) => i.arguments.last().map_or(start, |a| a.span.end),
        Instruction::From(i) => i
            .as_
            .as_ref()
            .map_or(i.image.span.end, |(_, name)| name.span.end),
        Instruction::Label(i) => i.arguments.span.end,
        Instruction::Maintainer(i) => i.name.span.end,
        Instruction::Run(i) => command_end(&i.arguments),
        Instruction::Shell(i) => i.arguments.last().map_or(start, |a| a.span.end + 1),
        Instruction::User(i) => i.arguments.span.end,
        Instruction::Workdir(i) => i.arguments.span.end,
        _ => start,
    };
    start..end.max(start)
}

fn command_end(c: &Command<'_>) -> usize {
    match c {
        Command::Exec(e) => e.span.end,
        Command::Shell(s) => s.span.end,
        _ => 0,
    }
}

fn form(c: &Command<'_>) -> Form {
    match c {
        Command::Exec(e) => Form::Exec(e.value.iter().map(|s| s.value.to_string()).collect()),
        Command::Shell(s) => Form::Shell(s.value.to_string()),
        _ => Form::Exec(Vec::new()),
    }
}

fn copy_step(
    line: usize,
    word: &str,
    options: &[parse_dockerfile::Flag<'_>],
    src: &[parse_dockerfile::Source<'_>],
    dest: &parse_dockerfile::UnescapedString<'_>,
) -> Result<Step> {
    let mut chown = None;
    let mut chmod = None;
    for flag in options {
        let value = flag.value.as_ref().map(|v| v.value.to_string());
        match (&*flag.name.value, value) {
            ("chown", Some(v)) => chown = Some(v),
            ("chmod", Some(v)) => chmod = Some(v),
            ("from", _) => {
                return Err(refuse(
                    line,
                    format!("{word} --from is not supported (multi-stage builds are not)"),
                ));
            }
            (name, _) => return Err(refuse(line, format!("{word} --{name} is not supported"))),
        }
    }
    let mut sources = Vec::new();
    for s in src {
        match s {
            parse_dockerfile::Source::Path(p) => sources.push(p.value.to_string()),
            _ => {
                return Err(refuse(
                    line,
                    format!("{word} from a here-document is not supported"),
                ));
            }
        }
    }
    Ok(Step::Copy {
        sources,
        dest: dest.value.to_string(),
        chown,
        chmod,
        add: false,
    })
}

/// ADD is COPY from the context; what it does beyond that is refused, not done differently.
pub fn refuse_add_source(line: usize, src: &str) -> Result<()> {
    if src.contains("://") || src.starts_with("git@") {
        return Err(refuse(
            line,
            format!(
                "ADD {src}: a URL is not fetched (the build has no network); download it in a RUN with `--allow`"
            ),
        ));
    }
    const ARCHIVES: &[&str] = &[
        ".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tar.zst",
    ];
    if ARCHIVES.iter().any(|s| src.ends_with(s)) {
        return Err(refuse(
            line,
            format!(
                "ADD {src}: an archive is not unpacked by this builder; COPY it and `RUN tar -xf` it"
            ),
        ));
    }
    Ok(())
}

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// `$NAME`, `${NAME}`, `${NAME:-word}` and `${NAME:+word}` replaced from `vars` (an unset
/// name is empty); `\$` is a plain `$`.
pub fn expand(text: &str, vars: &BTreeMap<String, String>) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                out.push('$');
                chars.next();
            }
            '$' => match chars.peek() {
                Some('{') => {
                    chars.next();
                    let mut inner = String::new();
                    let mut closed = false;
                    for c in chars.by_ref() {
                        if c == '}' {
                            closed = true;
                            break;
                        }
                        inner.push(c);
                    }
                    if !closed {
                        return Err(BuildError::Invalid(format!(
                            "{text:?}: a ${{ without its }}"
                        )));
                    }
                    let (name, op) = match inner.find(":-").or_else(|| inner.find(":+")) {
                        Some(i) => (&inner[..i], Some((&inner[i..i + 2], &inner[i + 2..]))),
                        None => (inner.as_str(), None),
                    };
                    if !is_name(name) {
                        return Err(BuildError::Invalid(format!(
                            "{text:?}: ${{{inner}}} is not a variable this builder expands"
                        )));
                    }
                    let value = vars.get(name).filter(|v| !v.is_empty());
                    match (op, value) {
                        (None, v) => out.push_str(v.map_or("", |v| v)),
                        (Some((":-", word)), None) => out.push_str(&expand(word, vars)?),
                        (Some((":-", _)), Some(v)) => out.push_str(v),
                        (Some((_, word)), Some(_)) => out.push_str(&expand(word, vars)?),
                        (Some(_), None) => {}
                    }
                }
                Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
                    let mut name = String::new();
                    while let Some(c) = chars.peek() {
                        if c.is_ascii_alphanumeric() || *c == '_' {
                            name.push(*c);
                            chars.next();
                        } else {
                            break;
                        }
                    }
                    out.push_str(vars.get(&name).map_or("", |v| v));
                }
                _ => out.push('$'),
            },
            c => out.push(c),
        }
    }
    Ok(out)
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Splits `text` into words as the shell would quote them (`"…"`, `'…'`, `\`), without
/// expanding anything. `expand_vars`: expand `$` outside single quotes with `vars`.
pub fn words(text: &str, vars: Option<&BTreeMap<String, String>>) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    let mut raw = String::new();
    let flush = |raw: &mut String, word: &mut String| -> Result<()> {
        if !raw.is_empty() {
            match vars {
                Some(v) => word.push_str(&expand(raw, v)?),
                None => word.push_str(raw),
            }
            raw.clear();
        }
        Ok(())
    };
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    flush(&mut raw, &mut word)?;
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                flush(&mut raw, &mut word)?;
                let mut closed = false;
                for c in chars.by_ref() {
                    if c == '\'' {
                        closed = true;
                        break;
                    }
                    word.push(c);
                }
                if !closed {
                    return Err(BuildError::Invalid(format!(
                        "{text:?}: a ' without its closing '"
                    )));
                }
            }
            '"' => {
                in_word = true;
                let mut closed = false;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\\' if matches!(chars.peek(), Some('"' | '\\')) => {
                            raw.push(chars.next().unwrap_or('\\'));
                        }
                        '\\' if chars.peek() == Some(&'$') => {
                            raw.push_str("\\$");
                            chars.next();
                        }
                        c => raw.push(c),
                    }
                }
                if !closed {
                    return Err(BuildError::Invalid(format!(
                        "{text:?}: a \" without its closing \""
                    )));
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some('$') => raw.push_str("\\$"),
                    Some(c) => raw.push(c),
                    None => raw.push('\\'),
                }
            }
            c => {
                in_word = true;
                raw.push(c);
            }
        }
    }
    if in_word {
        flush(&mut raw, &mut word)?;
        out.push(word);
    }
    Ok(out)
}

/// `KEY=VALUE …` pairs (ENV, LABEL, ARG with a value), or the old `KEY VALUE…` form of ENV
/// and LABEL (`legacy`), values expanded with `vars`.
pub fn pairs(
    text: &str,
    vars: &BTreeMap<String, String>,
    legacy: bool,
) -> Result<Vec<(String, Option<String>)>> {
    let first = text.split_whitespace().next().unwrap_or("");
    if legacy && !first.contains('=') {
        let value = text[text.find(first).unwrap_or(0) + first.len()..].trim();
        if value.is_empty() {
            return Err(BuildError::Invalid(format!(
                "{text:?}: a name without a value"
            )));
        }
        return Ok(vec![(first.to_string(), Some(expand(value, vars)?))]);
    }
    words(text, Some(vars))?
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), Some(v.to_string()))),
            None if is_name(&w) => Ok((w, None)),
            _ => Err(BuildError::Invalid(format!(
                "{text:?}: {w:?} is not NAME=VALUE"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn expansion_follows_docker() {
        let v = vars(&[("A", "x"), ("E", "")]);
        for (text, want) in [
            ("$A/b", "x/b"),
            ("${A}b", "xb"),
            ("${NOPE}", ""),
            ("${NOPE:-d}", "d"),
            ("${E:-d}", "d"),
            ("${A:-d}", "x"),
            ("${A:+y}", "y"),
            ("${NOPE:+y}", ""),
            ("\\$A", "$A"),
            ("a$", "a$"),
            ("$1", "$1"),
        ] {
            assert_eq!(expand(text, &v).unwrap(), want, "{text}");
        }
        assert!(expand("${A", &v).is_err());
        assert!(expand("${A/x/y}", &v).is_err());
    }

    #[test]
    fn env_pairs_in_both_forms() {
        let v = vars(&[("HOME", "/root")]);
        assert_eq!(
            pairs(r#"A=1 B="two words" C=$HOME/x D='$HOME'"#, &v, true).unwrap(),
            vec![
                ("A".into(), Some("1".into())),
                ("B".into(), Some("two words".into())),
                ("C".into(), Some("/root/x".into())),
                ("D".into(), Some("$HOME".into())),
            ]
        );
        assert_eq!(
            pairs("GREETING hello  world", &v, true).unwrap(),
            vec![("GREETING".into(), Some("hello  world".into()))]
        );
        assert_eq!(
            pairs("VERSION", &v, false).unwrap(),
            vec![("VERSION".into(), None)]
        );
        assert!(pairs(r#"A="open"#, &v, true).is_err());
    }

    #[test]
    fn a_dockerfile_becomes_steps_with_lines() {
        let text = "# comment\nARG BASE=busybox\nFROM $BASE\nRUN echo a \\\n  && echo b\n\
                    COPY --chown=1:2 a b /dst/\nENV K=v\nWORKDIR /w\nUSER 1000\n\
                    CMD [\"sh\", \"-c\", \"echo hi\"]\nEXPOSE 8080/tcp 53/udp\n";
        let steps = parse(text).unwrap();
        let kinds: Vec<_> = steps.iter().map(|p| (p.line, p.step.clone())).collect();
        assert_eq!(kinds[0], (2, Step::Arg("BASE=busybox".into())));
        assert_eq!(kinds[1], (3, Step::From("$BASE".into())));
        assert!(matches!(&kinds[2], (4, Step::Run(Form::Shell(s))) if s.contains("echo b")));
        assert_eq!(
            kinds[3].1,
            Step::Copy {
                sources: vec!["a".into(), "b".into()],
                dest: "/dst/".into(),
                chown: Some("1:2".into()),
                chmod: None,
                add: false,
            }
        );
        assert_eq!(kinds[3].0, 6);
        assert_eq!(
            kinds[7].1,
            Step::Cmd(Form::Exec(vec!["sh".into(), "-c".into(), "echo hi".into()]))
        );
        assert_eq!(
            kinds[8].1,
            Step::Expose(vec!["8080/tcp".into(), "53/udp".into()])
        );
        assert!(steps[2].text.starts_with("RUN echo a"));
    }

    #[test]
    fn what_is_not_built_is_refused_by_line() {
        for (text, says) in [
            ("FROM a\nFROM b\n", "line 2: a second FROM"),
            ("RUN x\n", "expected FROM at line 1"),
            (
                "FROM a\nADD https://example.test/x /x\n",
                "line 2: ADD https",
            ),
            ("FROM a\nADD x.tar.gz /x\n", "an archive is not unpacked"),
            (
                "FROM a\nCOPY --from=b /x /y\n",
                "COPY --from is not supported",
            ),
            (
                "FROM a\nRUN --network=host x\n",
                "RUN --network is not supported",
            ),
            ("FROM a\nHEALTHCHECK NONE\n", "HEALTHCHECK is not supported"),
            (
                "FROM a\nRUN true\nENV ONLY\n",
                "line 3: \"ONLY\": a name without a value",
            ),
            ("ARG X\n", "expected at least one FROM"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }
}
