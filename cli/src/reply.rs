//! How a command says what the gateway answered: printed and flushed, an empty list as a
//! note on stderr, every page of a list, a NOT_FOUND as "absent", a delete's answer. Every
//! command module prints through here; none needs the dispatcher (`run.rs`) for it.

use std::collections::HashSet;
use std::future::Future;
use std::io::Write;

use super::CliError;
use super::output::{DeletedView, render_deleted};

/// Writes `text` to stdout and flushes.
pub fn print(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Prints a rendered list; an empty table becomes a note on stderr, as kubectl does, so stdout
/// stays empty.
pub fn print_list(rendered: &str, empty_note: &str) -> Result<(), CliError> {
    if rendered.is_empty() {
        eprintln!("{empty_note}");
        Ok(())
    } else {
        print(rendered)
    }
}

/// Fetches every page: `fetch(token)` returns one page and the next token (empty at the end).
/// A token seen twice is an error rather than an endless loop.
pub async fn collect_pages<T, F, Fut>(mut fetch: F) -> Result<Vec<T>, CliError>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<(Vec<T>, String), tonic::Status>>,
{
    let mut items = Vec::new();
    let mut seen_tokens = HashSet::new();
    let mut token = String::new();
    loop {
        let (page, next) = fetch(token).await?;
        items.extend(page);
        if next.is_empty() {
            return Ok(items);
        }
        if !seen_tokens.insert(next.clone()) {
            return Err(CliError::PageTokenRepeated { token: next });
        }
        token = next;
    }
}

/// The object a get found, `None` when it answered NOT_FOUND; other errors stay errors.
pub fn found_or_absent<T>(
    answer: Result<tonic::Response<T>, tonic::Status>,
) -> Result<Option<T>, CliError> {
    match answer {
        Ok(answer) => Ok(Some(answer.into_inner())),
        Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
        Err(status) => Err(status.into()),
    }
}

/// Prints a delete's answer; `found` is the (id, name) looked up just before it.
pub fn print_deleted(
    output: &super::OutputArgs,
    deleted: bool,
    found: Option<(String, String)>,
    what: &str,
    kind: &str,
) -> Result<(), CliError> {
    let (id, name) = found.unzip();
    let view = DeletedView { deleted, id };
    let name = name.unwrap_or_default();
    print(&render_deleted(
        output,
        &view,
        what,
        &format!("{kind}/{name}"),
    )?)
}
