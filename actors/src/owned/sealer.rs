//! Sealing providers' credentials at rest: ChaCha20-Poly1305 (`ring::aead`) under a gateway
//! key, and fingerprints (HMAC-SHA256, `ring::hmac`) that tell two values apart without
//! revealing either.
//!
//! The key file (`secrets.key` in sbxd's data dir) holds 64 random bytes: 32 for the cipher,
//! 32 for the fingerprints. It is made once, mode 0600, with `O_EXCL` (two gateways racing to
//! make it cannot end up with two keys), and refused when it is readable by others or of the
//! wrong size. Each sealed value has a fresh random 96-bit nonce (stored in front of the
//! ciphertext) and is bound, as associated data, to its provider's id and its credential's
//! name: a ciphertext copied into another provider or under another name does not open. A
//! store backup does not hold the key; without the same key file a restored gateway cannot
//! open the credentials (it says so at the start that needs them).

use std::fmt;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use ring::{hkdf, hmac};
use uuid::Uuid;

use crate::error::{ActorError, Result};

const KEY_FILE_LEN: usize = 64;

/// Seals and opens credential values, and fingerprints them.
pub struct Sealer {
    cipher: LessSafeKey,
    fingerprint: hmac::Key,
    /// Derived from the fingerprint half by HKDF under its own salt: the tokens it makes
    /// ([`Sealer::token`]) are not HMACs any fingerprint, which users may ask for any value,
    /// could give away.
    tokens: hmac::Key,
    rng: SystemRandom,
    /// Where the key came from, for errors ("an in-memory key" for tests).
    origin: String,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sealer({})", self.origin)
    }
}

impl Sealer {
    /// The key in `path`, made (0600) if the file does not exist.
    pub fn open_or_create(path: &Path) -> Result<Sealer> {
        let bad = |why: String| {
            ActorError::FailedPrecondition(format!("the secrets key {}: {why}", path.display()))
        };
        let mut bytes = Vec::with_capacity(KEY_FILE_LEN);
        match fs::File::open(path) {
            Ok(mut file) => {
                let mode = file
                    .metadata()
                    .map_err(|e| bad(e.to_string()))?
                    .permissions()
                    .mode();
                if mode & 0o077 != 0 {
                    return Err(bad(format!(
                        "its mode is {:o}; it must be readable by its owner only (chmod 600)",
                        mode & 0o777
                    )));
                }
                file.read_to_end(&mut bytes)
                    .map_err(|e| bad(format!("cannot be read: {e}")))?;
                if bytes.len() != KEY_FILE_LEN {
                    return Err(bad(format!(
                        "holds {} bytes, a key is {KEY_FILE_LEN}; it is damaged (restore it from \
                         the backup of the data dir, or move it away to start with no readable \
                         credentials)",
                        bytes.len()
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bytes.resize(KEY_FILE_LEN, 0);
                SystemRandom::new()
                    .fill(&mut bytes)
                    .map_err(|_| bad("the system's random source failed".into()))?;
                write_new_key(path, &bytes).map_err(|e| bad(format!("cannot be made: {e}")))?;
                tracing::info!(path = %path.display(), "made a new key for providers' credentials");
            }
            Err(e) => return Err(bad(format!("cannot be opened: {e}"))),
        }
        Sealer::from_bytes(&bytes, path.display().to_string())
    }

    /// A key that lives in memory only (tests, and gateways without a data dir): credentials
    /// sealed under it cannot be opened after a restart.
    pub fn ephemeral() -> Sealer {
        let mut bytes = [0u8; KEY_FILE_LEN];
        SystemRandom::new()
            .fill(&mut bytes)
            .expect("the system's random source works");
        Sealer::from_bytes(&bytes, "an in-memory key".into()).expect("64 bytes make a key")
    }

    fn from_bytes(bytes: &[u8], origin: String) -> Result<Sealer> {
        let cipher = UnboundKey::new(&CHACHA20_POLY1305, &bytes[..32])
            .map_err(|_| ActorError::Internal("the secrets key does not make a cipher".into()))?;
        Ok(Sealer {
            cipher: LessSafeKey::new(cipher),
            fingerprint: hmac::Key::new(hmac::HMAC_SHA256, &bytes[32..]),
            tokens: hkdf::Salt::new(hkdf::HKDF_SHA256, b"sbx bearer tokens of objects")
                .extract(&bytes[32..])
                .expand(&[b"v1"], hmac::HMAC_SHA256)
                .map_err(|_| {
                    ActorError::Internal("the secrets key does not make a token key".into())
                })?
                .into(),
            rng: SystemRandom::new(),
            origin,
        })
    }

    /// `value` sealed for credential `name` of provider `provider`: nonce ‖ ciphertext ‖ tag.
    pub fn seal(&self, provider: Uuid, name: &str, value: &str) -> Result<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| ActorError::Internal("the system's random source failed".into()))?;
        let mut out = value.as_bytes().to_vec();
        self.cipher
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(associated(provider, name)),
                &mut out,
            )
            .map_err(|_| ActorError::Internal("sealing a credential failed".into()))?;
        let mut sealed = nonce.to_vec();
        sealed.extend(out);
        Ok(sealed)
    }

    /// The value [`Sealer::seal`] sealed; an error (naming the credential, never a value) when
    /// it was sealed under another key, for another provider or name, or was changed.
    pub fn open(&self, provider: Uuid, name: &str, sealed: &[u8]) -> Result<String> {
        let refuse = || {
            ActorError::FailedPrecondition(format!(
                "credential {name:?} of provider {provider} cannot be opened with {} (sealed \
                 under another key, or damaged); set it again with `sbx provider update`",
                self.origin
            ))
        };
        if sealed.len() < NONCE_LEN {
            return Err(refuse());
        }
        let (nonce, body) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| refuse())?;
        let mut body = body.to_vec();
        let plain = self
            .cipher
            .open_in_place(nonce, Aad::from(associated(provider, name)), &mut body)
            .map_err(|_| refuse())?;
        String::from_utf8(plain.to_vec()).map_err(|_| refuse())
    }

    /// A bearer token for `value` (an object's id) and `purpose`: the whole HMAC-SHA256 under
    /// the token key, 64 hex digits. Unlike a fingerprint it cannot be had by asking for the
    /// fingerprint of a chosen value.
    pub fn token(&self, purpose: &str, value: &str) -> String {
        let mut message = purpose.as_bytes().to_vec();
        message.push(0);
        message.extend_from_slice(value.as_bytes());
        hex::encode(hmac::sign(&self.tokens, &message).as_ref())
    }

    /// The first 16 hex digits of HMAC-SHA256(value) under the fingerprint key.
    pub fn fingerprint(&self, value: &str) -> String {
        let tag = hmac::sign(&self.fingerprint, value.as_bytes());
        hex::encode(&tag.as_ref()[..8])
    }
}

fn associated(provider: Uuid, name: &str) -> Vec<u8> {
    let mut aad = provider.as_bytes().to_vec();
    aad.extend_from_slice(name.as_bytes());
    aad
}

/// Writes a new key file: `O_EXCL`, mode 0600, synced, and its directory synced.
fn write_new_key(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    let dir: PathBuf = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_only_for_its_provider_and_name() {
        let s = Sealer::ephemeral();
        let p = Uuid::new_v4();
        let sealed = s.seal(p, "TOKEN", "hunter2").unwrap();
        assert!(
            !sealed.windows(7).any(|w| w == b"hunter2"),
            "the value is not in the clear"
        );
        assert_eq!(s.open(p, "TOKEN", &sealed).unwrap(), "hunter2");
        assert!(s.open(Uuid::new_v4(), "TOKEN", &sealed).is_err());
        assert!(s.open(p, "OTHER", &sealed).is_err());
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(s.open(p, "TOKEN", &flipped).is_err());
        let other_key = Sealer::ephemeral();
        let err = other_key.open(p, "TOKEN", &sealed).unwrap_err().to_string();
        assert!(err.contains("TOKEN") && !err.contains("hunter2"), "{err}");
        // Two seals of one value differ (fresh nonces); their fingerprints do not.
        assert_ne!(s.seal(p, "TOKEN", "hunter2").unwrap(), sealed);
        assert_eq!(s.fingerprint("hunter2"), s.fingerprint("hunter2"));
        assert_ne!(s.fingerprint("hunter2"), s.fingerprint("hunter3"));
        assert_eq!(s.fingerprint("x").len(), 16);
    }

    #[test]
    fn tokens_are_per_purpose_and_value_and_no_fingerprint_gives_one_away() {
        let s = Sealer::ephemeral();
        let id = Uuid::new_v4().to_string();
        let token = s.token("e2b envd", &id);
        assert_eq!(token.len(), 64);
        assert_eq!(token, s.token("e2b envd", &id));
        assert_ne!(token, s.token("e2b envd", &Uuid::new_v4().to_string()));
        assert_ne!(token, s.token("other", &id));
        assert_ne!(token, Sealer::ephemeral().token("e2b envd", &id));
        // Fingerprints of the token's own message, or of the id, say nothing of it.
        for value in [format!("e2b envd\0{id}"), id.clone()] {
            assert!(!token.contains(&s.fingerprint(&value)), "{value}");
        }
    }

    #[test]
    fn the_key_file_is_made_once_0600_and_refused_when_open_to_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.key");
        let first = Sealer::open_or_create(&path).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let p = Uuid::new_v4();
        let sealed = first.seal(p, "K", "v").unwrap();
        // Reopened: the same key.
        let again = Sealer::open_or_create(&path).unwrap();
        assert_eq!(again.open(p, "K", &sealed).unwrap(), "v");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = Sealer::open_or_create(&path).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(&path, b"short").unwrap();
        let err = Sealer::open_or_create(&path).unwrap_err().to_string();
        assert!(err.contains("5 bytes"), "{err}");
    }
}
