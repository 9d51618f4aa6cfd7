//! The sandbox access token of the E2B API (`envdAccessToken` in a create's or connect's
//! answer; the SDK sends it as `X-Access-Token` to the in-sandbox API, and as E2B's traffic
//! token to a sandbox's ports): who holds it acts on that one sandbox as the identity whose
//! key was given it.
//!
//! A token is `BASE64URL(NAME).HMAC`: the identity's name, and an HMAC-SHA256 under the
//! gateway's token key (`Sealer::token`) of the sandbox's id, that name and the hash of the
//! key the identity authenticated with ([`Caller::key_binding`]). So it is bound to the key,
//! not only to the sandbox: when the key is revoked or expires (`sbxd token revoke`), or the
//! name is given another key, every token minted for it stops working at once, across
//! restarts (the identities file is read as it changes; the token key is on disk); a token
//! dies with its sandbox (the id is in the HMAC, and a deleted sandbox is found nowhere); and
//! it grants no more than its identity's grants hold now (a grant taken away ends it too).
//! Without the gateway's token key no token can be made for a name, and a name alone names
//! nobody's sandbox.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use subtle::ConstantTimeEq;

use super::E2b;
use crate::auth::Caller;

/// The HMAC's purpose string (a token of another purpose is never this one).
const PURPOSE: &str = "e2b sandbox access v2";

/// The longest token looked at (a name is at most a few hundred bytes).
const MAX_TOKEN: usize = 1024;

fn tag(e2b: &E2b, sandbox_id: &str, name: &str, binding: &str) -> String {
    let value = format!("{sandbox_id}\0{name}\0{binding}");
    e2b.secrets.token(PURPOSE, &value)
}

/// The token `caller` gets for the sandbox `sandbox_id`.
pub fn mint(e2b: &E2b, caller: &Caller, sandbox_id: &str) -> String {
    let name = B64URL.encode(caller.name.as_bytes());
    format!(
        "{name}.{}",
        tag(e2b, sandbox_id, &caller.name, caller.key_binding())
    )
}

/// Why a token was refused (for the audit line; the client is told only that it was).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// No token, or not one of ours for this sandbox.
    Invalid,
    /// A token for an identity that is gone (revoked, expired) or holds another key now.
    Revoked(String),
    /// The identity no longer holds the sandbox's workspace as an editor.
    NotGranted(String),
    /// The identities could not be read.
    Unavailable,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Invalid => f.write_str("no valid sandbox token"),
            Refused::Revoked(who) => {
                write!(f, "a token of {who}, whose key is revoked or replaced")
            }
            Refused::NotGranted(who) => write!(f, "{who} no longer holds the sandbox's workspace"),
            Refused::Unavailable => f.write_str("the identities could not be read"),
        }
    }
}

/// The caller the token `token` stands for on the sandbox `sandbox_id` of the workspace
/// `workspace_id`, or why it stands for nobody.
pub fn verify(
    e2b: &E2b,
    token: &str,
    sandbox_id: &str,
    workspace_id: &str,
) -> Result<Caller, Refused> {
    if token.is_empty() || token.len() > MAX_TOKEN {
        return Err(Refused::Invalid);
    }
    let (name, presented) = token.rsplit_once('.').ok_or(Refused::Invalid)?;
    let name = B64URL
        .decode(name)
        .ok()
        .and_then(|n| String::from_utf8(n).ok())
        .ok_or(Refused::Invalid)?;
    let (caller, binding) = match e2b.auth.token_holder(&name) {
        Ok(Some(found)) => found,
        // Nobody of that name now (revoked, expired): the name is the token's, so bounded
        // before it reaches a log.
        Ok(None) => {
            return Err(Refused::Revoked(
                sbx_actors::limits::truncate(&name, 64).to_string(),
            ));
        }
        Err(_) => return Err(Refused::Unavailable),
    };
    let expected = tag(e2b, sandbox_id, &name, &binding);
    if !bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
        // The name lives but this is not its key's token: another key, or a forgery.
        return Err(Refused::Invalid);
    }
    if !caller.may(workspace_id, crate::auth::Role::Editor) {
        return Err(Refused::NotGranted(name));
    }
    Ok(caller)
}
