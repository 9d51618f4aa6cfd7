//! How a command says what the gateway answered: printed and flushed, an empty list as a
//! note on stderr, every page of a list, a NOT_FOUND as "absent", a delete's answer. Every
//! noun (`cmd/*`) prints through here.

use std::collections::HashSet;
use std::future::Future;
use std::io::Write;

use super::CliError;
use super::args::{ScopeArgs, describe_sandbox};
use super::output::{DeletedView, OutputArgs, RemovedView, render_deleted, render_removed};

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
    output: &OutputArgs,
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

/// Prints the answer of a delete (or detach) of something of a sandbox: `what` ("setting
/// \"k\" of") and the sandbox, then whether it was `verb`.
pub fn print_removed(
    output: &OutputArgs,
    deleted: bool,
    what: &str,
    scope: &ScopeArgs,
    sandbox: &str,
    verb: &str,
) -> Result<(), CliError> {
    let removed = RemovedView {
        deleted,
        detached: Vec::new(),
    };
    let what = format!("{what} {}", describe_sandbox(scope, sandbox));
    print(&render_removed(output, &removed, &what, verb)?)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// Serves `pages` as (items, next token) and records the tokens asked for.
    async fn paginate(pages: Vec<(Vec<u32>, &str)>) -> (Result<Vec<u32>, CliError>, Vec<String>) {
        let mut pages: VecDeque<_> = pages.into();
        let mut asked = Vec::new();
        let result = collect_pages(|token| {
            asked.push(token);
            let page = pages.pop_front();
            async move {
                match page {
                    Some((items, next)) => Ok((items, next.to_string())),
                    None => Err(tonic::Status::internal("asked past the last page")),
                }
            }
        })
        .await;
        (result, asked)
    }

    #[tokio::test]
    async fn pages_are_followed_to_the_end() {
        let (result, asked) =
            paginate(vec![(vec![1, 2], "t1"), (vec![3], "t2"), (vec![], "")]).await;
        assert_eq!(result.unwrap(), [1, 2, 3]);
        assert_eq!(asked, ["", "t1", "t2"]);
    }

    #[tokio::test]
    async fn a_repeated_page_token_stops_the_listing() {
        let (result, asked) = paginate(vec![(vec![1], "t1"), (vec![2], "t1")]).await;
        assert!(
            matches!(&result, Err(CliError::PageTokenRepeated { token }) if token == "t1"),
            "{result:?}"
        );
        assert_eq!(asked.len(), 2);
    }
}
