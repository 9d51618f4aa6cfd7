//! `sbxd certs init`: a private CA, a server certificate and client certificates, for people
//! without a PKI of their own, so that TLS (and mutual TLS) is one command away.
//!
//! What is made (ECDSA P-256 keys, the rcgen default; every file PEM):
//! - `ca.pem`, `ca-key.pem`: the CA, valid for [`CA_DAYS`] days (or `--days` when longer) so
//!   that client certificates can be added later without remaking it (and redistributing it);
//! - `server.pem`, `server-key.pem`: the server's certificate for the `--name`s (IP addresses
//!   in IP SANs, the others DNS SANs; default localhost, 127.0.0.1, ::1), serverAuth;
//! - `client-NAME.pem`, `client-NAME-key.pem`: per `--client NAME`, CN = NAME (what the server
//!   sees as the caller, [`crate::tls::peer_identity`]), clientAuth.
//!
//! Leaves are valid `--days` (default 365) from an hour ago (clock skew between hosts).
//! Keys are mode 0600, certificates 0644, the directory 0700 when made here. Every file is
//! written to a temporary file in the directory first and renamed into place only when all
//! are written, so a failure leaves no half-written file. Existing files are not overwritten
//! without `--force`. With `--client` only and a CA in the directory, the CA signs the new
//! client certificates and nothing else is touched: an operator issues more later.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use sha2::Digest as _;
use x509_parser::time::ASN1Time;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData as _, SanType,
};

/// The server names a certificate is made for when no `--name` is given.
pub const DEFAULT_SERVER_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// How long a CA made here is valid, in days (10 years), unless `--days` asks for longer.
pub const CA_DAYS: u32 = 3650;

/// The longest `--days` accepted (about 27 years).
pub const MAX_DAYS: u32 = 10_000;

/// The longest client name: the X.520 upper bound of a common name (ub-common-name).
const MAX_CLIENT_NAME: usize = 64;

/// `sbxd certs init`: make a CA, a server certificate and client certificates.
#[derive(Debug, Clone, clap::Args)]
pub struct CertsInitArgs {
    /// Directory to write the files to (made, mode 0700, if missing). Default: DATA/tls.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// DNS name or IP address the server certificate is for; repeat or list several
    /// (default: localhost 127.0.0.1 ::1). The first is also its common name. A wildcard
    /// `*.DOMAIN` covers the names one label under DOMAIN (the E2B listener's
    /// PORT-ID.DOMAIN hosts, with `sbxd serve --e2b-domain DOMAIN`).
    #[arg(long = "name", value_name = "NAME", num_args = 1..)]
    pub names: Vec<String>,

    /// Make a client certificate with common name NAME (the caller's identity under mutual
    /// TLS); repeat or list several. With --client only and a CA already in DIR, that CA
    /// signs them and nothing else is made.
    #[arg(long = "client", value_name = "NAME", num_args = 1..)]
    pub clients: Vec<String>,

    /// Days the server and client certificates are valid.
    #[arg(long, value_name = "N", default_value_t = 365,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_DAYS)))]
    pub days: u32,

    /// Overwrite files that exist already (with --client only, the CA in DIR still signs).
    #[arg(long)]
    pub force: bool,

    /// The daemon's data directory (not a flag: the caller fills it from --data-dir), for the
    /// default DIR.
    #[arg(skip)]
    pub data_dir: Option<PathBuf>,
}

impl CertsInitArgs {
    /// The directory to write to: `--dir`, else DATA/tls.
    pub fn target_dir(&self) -> Result<PathBuf, CertsError> {
        match (&self.dir, &self.data_dir) {
            (Some(dir), _) => Ok(dir.clone()),
            (None, Some(data)) => Ok(data.join("tls")),
            (None, None) => Err(CertsError::NoDir),
        }
    }
}

/// What went wrong in `sbxd certs init`; each names the file or name it is about.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("no directory for the certificates: pass --dir (or --data-dir, for DATA/tls)")]
    NoDir,
    #[error(
        "the server name {name:?} is neither an IP address nor a valid DNS name (letters, digits, '-' and '.', labels of at most 63)"
    )]
    BadServerName { name: String },
    #[error(
        "the client name {name:?} is not usable: {reason} (letters, digits, '.', '_' and '-', at most {MAX_CLIENT_NAME}, not starting with '.' or '-')"
    )]
    BadClientName { name: String, reason: &'static str },
    #[error("--days {days} is out of range 1..={MAX_DAYS}")]
    BadDays { days: u32 },
    #[error("refusing to overwrite {} (pass --force to replace them)", list(paths))]
    Exists { paths: Vec<PathBuf> },
    #[error(
        "{} is there but {} is not: cannot sign client certificates without both (restore it, or make a new CA: --name NAME... --force)",
        present.display(), missing.display()
    )]
    IncompleteCa { present: PathBuf, missing: PathBuf },
    #[error("cannot read the CA file {}: {reason}", path.display())]
    BadCa { path: PathBuf, reason: String },
    #[error(
        "the CA {} expires {not_after}, before certificates of --days {days} would: pass fewer --days, or make a new CA",
        path.display()
    )]
    CaExpires {
        path: PathBuf,
        not_after: String,
        days: u32,
    },
    #[error("cannot make the {what}: {source}")]
    Generate { what: String, source: rcgen::Error },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Makes the certificates `args` asks for in `dir` (see the module doc) and returns the paths
/// written, CA first, keys after their certificates.
pub fn init(args: &CertsInitArgs, dir: &Path) -> Result<Vec<PathBuf>, CertsError> {
    if args.days == 0 || args.days > MAX_DAYS {
        return Err(CertsError::BadDays { days: args.days });
    }
    let clients = client_names(&args.clients)?;
    let ca_cert_path = dir.join("ca.pem");
    let ca_key_path = dir.join("ca-key.pem");
    let clients_only = args.names.is_empty() && !clients.is_empty();
    let reuse_ca = clients_only && (ca_cert_path.exists() || ca_key_path.exists());

    let now = ASN1Time::now().to_datetime();
    let not_before = ASN1Time::new(now - Duration::from_secs(3600));
    let leaf_not_after = ASN1Time::new(now + days(args.days));

    let mut files: Vec<(PathBuf, String, u32)> = Vec::new();
    let (issuer, ca_not_after) = if reuse_ca {
        for (present, missing) in [(&ca_cert_path, &ca_key_path), (&ca_key_path, &ca_cert_path)] {
            if !missing.exists() {
                return Err(CertsError::IncompleteCa {
                    present: present.clone(),
                    missing: missing.clone(),
                });
            }
        }
        load_ca(&ca_cert_path, &ca_key_path)?
    } else {
        let names = server_names(&args.names)?;
        let key = generate("CA key")?;
        let mut params = CertificateParams::default();
        // Named after its key, so that two CAs made here have different names: a verifier
        // looks the issuer up by name, and one of the same name would be tried (and fail on
        // the signature, "DecryptError") instead of being reported as unknown.
        let key_id = sha2::Sha256::digest(key.subject_public_key_info());
        params.distinguished_name = dn(&format!("sbx CA {}", hex::encode(&key_id[..6])));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = not_before.to_datetime();
        params.not_after = now + days(args.days.max(CA_DAYS));
        let ca_not_after = ASN1Time::new(params.not_after);
        let cert = params
            .self_signed(&key)
            .map_err(|source| CertsError::Generate {
                what: "CA certificate".into(),
                source,
            })?;
        files.push((ca_cert_path.clone(), cert.pem(), 0o644));
        files.push((ca_key_path.clone(), key.serialize_pem(), 0o600));
        let issuer = Issuer::new(params, key);

        let (first, _) = &names[0];
        let mut params = leaf_params(first, not_before, leaf_not_after);
        params.subject_alt_names = names.into_iter().map(|(_, san)| san).collect();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let (cert, key) = signed("server certificate", &params, &issuer)?;
        files.push((dir.join("server.pem"), cert, 0o644));
        files.push((dir.join("server-key.pem"), key, 0o600));
        (issuer, ca_not_after)
    };
    if ca_not_after < leaf_not_after {
        return Err(CertsError::CaExpires {
            path: ca_cert_path,
            not_after: ca_not_after.to_string(),
            days: args.days,
        });
    }
    for name in &clients {
        let mut params = leaf_params(name, not_before, leaf_not_after);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let (cert, key) = signed(&format!("client certificate {name}"), &params, &issuer)?;
        files.push((dir.join(format!("client-{name}.pem")), cert, 0o644));
        files.push((dir.join(format!("client-{name}-key.pem")), key, 0o600));
    }

    if !args.force {
        let existing: Vec<PathBuf> = files
            .iter()
            .map(|(path, _, _)| path.clone())
            .filter(|path| path.symlink_metadata().is_ok())
            .collect();
        if !existing.is_empty() {
            return Err(CertsError::Exists { paths: existing });
        }
    }
    write_all(dir, files)
}

/// The port the commands [`describe`] prints use (any free port works).
pub const SUGGESTED_PORT: u16 = 7070;

/// Where the printed commands have sbxd listen and sbx connect, from the server certificate's
/// names (`names` as given to `--name`; empty: the defaults): a first name that is an IP
/// address is listened on as it is; a DNS name means every interface (`0.0.0.0`), or loopback
/// for `localhost`. The endpoint is the first name that is not a wildcard.
pub fn suggested_addresses(names: &[String]) -> (String, String) {
    let names: Vec<&str> = if names.is_empty() {
        DEFAULT_SERVER_NAMES.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    let host = names
        .iter()
        .find(|n| !n.starts_with("*."))
        .copied()
        .unwrap_or("localhost");
    let port = SUGGESTED_PORT;
    let (listen, endpoint) = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => {
            let at = std::net::SocketAddr::new(ip, port);
            (at.to_string(), format!("https://{at}"))
        }
        Err(_) if host == "localhost" => (
            format!("127.0.0.1:{port}"),
            format!("https://localhost:{port}"),
        ),
        Err(_) => (format!("0.0.0.0:{port}"), format!("https://{host}:{port}")),
    };
    (listen, endpoint)
}

/// What each file is for and the flags that use them, for the command to print: one line per
/// path, then the sbxd and sbx commands for the server and each client certificate written,
/// whole (`--listen` and `--endpoint` from [`suggested_addresses`] of `names`), to be pasted.
pub fn describe(paths: &[PathBuf], names: &[String]) -> String {
    let (listen, endpoint) = suggested_addresses(names);
    let file_name = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let mut files = String::new();
    let mut commands = String::new();
    for path in paths {
        let file = file_name(path);
        let sibling = |name: &str| path.with_file_name(name).display().to_string();
        let client = file
            .strip_prefix("client-")
            .and_then(|f| f.strip_suffix(".pem"));
        let what = match (file.as_str(), client) {
            ("ca.pem", _) => "the CA certificate: sbx trusts it (--tls-ca), sbxd checks client \
                certificates against it (--tls-client-ca)"
                .to_owned(),
            ("ca-key.pem", _) => "the CA's private key: it signs more client certificates \
                (sbxd certs init --client NAME); keep it secret, and off the server if you can"
                .to_owned(),
            ("server.pem", _) => {
                let _ = writeln!(
                    commands,
                    "sbxd serve --listen {listen} --tls-cert {} --tls-key {} --tls-client-ca {}",
                    path.display(),
                    sibling("server-key.pem"),
                    sibling("ca.pem"),
                );
                "the server's certificate (sbxd --tls-cert)".to_owned()
            }
            ("server-key.pem", _) => "the server's private key (sbxd --tls-key)".to_owned(),
            (_, Some(name)) if name.ends_with("-key") => format!(
                "the private key of client {} (sbx --tls-key)",
                name.trim_end_matches("-key")
            ),
            (_, Some(name)) => {
                let _ = writeln!(
                    commands,
                    "sbx --tls-ca {} --tls-cert {} --tls-key {} --endpoint {endpoint} version",
                    sibling("ca.pem"),
                    path.display(),
                    sibling(&format!("client-{name}-key.pem")),
                );
                format!("the certificate of client {name}, its identity on sbxd (sbx --tls-cert)")
            }
            _ => "not made by sbxd certs init".to_owned(),
        };
        let _ = writeln!(files, "{}: {what}", path.display());
    }
    if commands.is_empty() {
        files
    } else {
        format!("{files}\n{commands}")
    }
}

/// Days as a duration.
fn days(n: u32) -> Duration {
    Duration::from_secs(u64::from(n) * 86_400)
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "sbx");
    dn.push(DnType::CommonName, common_name);
    dn
}

fn leaf_params(common_name: &str, not_before: ASN1Time, not_after: ASN1Time) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(common_name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before.to_datetime();
    params.not_after = not_after.to_datetime();
    params
}

fn generate(what: &str) -> Result<KeyPair, CertsError> {
    KeyPair::generate().map_err(|source| CertsError::Generate {
        what: what.to_owned(),
        source,
    })
}

/// A fresh key and its certificate signed by `issuer`, both PEM.
fn signed(
    what: &str,
    params: &CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(String, String), CertsError> {
    let key = generate(&format!("key of the {what}"))?;
    let cert = params
        .signed_by(&key, issuer)
        .map_err(|source| CertsError::Generate {
            what: what.to_owned(),
            source,
        })?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The CA in `cert`/`key`, checked to be a CA whose key is `key`, and its expiry.
fn load_ca(cert: &Path, key: &Path) -> Result<(Issuer<'static, KeyPair>, ASN1Time), CertsError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|e| CertsError::BadCa {
            path: path.to_owned(),
            reason: e.to_string(),
        })
    };
    let bad = |path: &Path, reason: String| CertsError::BadCa {
        path: path.to_owned(),
        reason,
    };
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let key_pair =
        KeyPair::from_pem(&key_pem).map_err(|e| bad(key, format!("not a private key: {e}")))?;
    let der = rustls::pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| bad(cert, format!("no certificate: {e}")))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| bad(cert, format!("not a certificate: {e}")))?;
    if !parsed.is_ca() {
        return Err(bad(
            cert,
            "not a CA certificate (no CA basic constraint)".into(),
        ));
    }
    if parsed.public_key().raw != key_pair.subject_public_key_info().as_slice() {
        return Err(bad(
            key,
            format!("not the key of the CA certificate {}", cert.display()),
        ));
    }
    let not_after = parsed.validity().not_after;
    let issuer = Issuer::from_ca_cert_der(&der, key_pair)
        .map_err(|e| bad(cert, format!("cannot sign with it: {e}")))?;
    Ok((issuer, not_after))
}

/// The server names, deduplicated in order, each with its SAN: IP addresses as IP SANs,
/// the others DNS names (checked as such).
fn server_names(names: &[String]) -> Result<Vec<(String, SanType)>, CertsError> {
    let names: Vec<String> = if names.is_empty() {
        DEFAULT_SERVER_NAMES
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    } else {
        names.to_vec()
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for name in names {
        if !seen.insert(name.clone()) {
            continue;
        }
        let bad = || CertsError::BadServerName { name: name.clone() };
        let san = match name.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => {
                // A wildcard (`*.DOMAIN`, one whole leftmost label) covers every name one
                // label under DOMAIN: the E2B listener's PORT-ID.DOMAIN hosts.
                let checked = name.strip_prefix("*.").unwrap_or(&name);
                rustls::pki_types::DnsName::try_from(checked).map_err(|_| bad())?;
                if !checked.contains('.') && checked != name {
                    return Err(bad());
                }
                SanType::DnsName(name.as_str().try_into().map_err(|_| bad())?)
            }
        };
        out.push((name, san));
    }
    Ok(out)
}

/// The client names, deduplicated in order, each usable as a common name and in a file name.
fn client_names(names: &[String]) -> Result<Vec<String>, CertsError> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for name in names {
        let bad = |reason| CertsError::BadClientName {
            name: name.clone(),
            reason,
        };
        if name.is_empty() {
            return Err(bad("it is empty"));
        }
        if name.len() > MAX_CLIENT_NAME {
            return Err(bad("it is too long"));
        }
        if name.starts_with(['.', '-']) {
            return Err(bad("it starts with '.' or '-'"));
        }
        if name.ends_with("-key") {
            return Err(bad(
                "it ends with '-key' (client-NAME.pem would pass for a key)",
            ));
        }
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(bad("it has a character other than those"));
        }
        if seen.insert(name.clone()) {
            out.push(name.clone());
        }
    }
    Ok(out)
}

/// Writes every file to a temporary file in `dir` (with its mode from the start), then
/// renames them all into place and syncs the directory.
fn write_all(dir: &Path, files: Vec<(PathBuf, String, u32)>) -> Result<Vec<PathBuf>, CertsError> {
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source| CertsError::Write { path, source }
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(write_err(dir))?;
    }
    let mut staged = Vec::with_capacity(files.len());
    for (path, contents, mode) in files {
        let mut tmp = tempfile::Builder::new()
            .prefix(".certs-init-")
            .permissions(std::fs::Permissions::from_mode(mode))
            .tempfile_in(dir)
            .map_err(write_err(dir))?;
        // The mode again: the temporary file is made under the umask.
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(write_err(&path))?;
        tmp.write_all(contents.as_bytes())
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(write_err(&path))?;
        staged.push((path, tmp));
    }
    let mut written = Vec::with_capacity(staged.len());
    for (path, tmp) in staged {
        tmp.persist(&path).map_err(|e| CertsError::Write {
            path: path.clone(),
            source: e.error,
        })?;
        written.push(path);
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_err(dir))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_take_addresses_names_and_one_leftmost_wildcard() {
        let names = |list: &[&str]| {
            server_names(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .map(|v| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>())
        };
        assert_eq!(
            names(&["api.e2b.test", "*.e2b.test", "127.0.0.1", "api.e2b.test"]).unwrap(),
            ["api.e2b.test", "*.e2b.test", "127.0.0.1"]
        );
        for bad in [
            "*", "*.com", "a.*.test", "*a.test", "**.test", "bad name", "",
        ] {
            assert!(
                matches!(names(&[bad]), Err(CertsError::BadServerName { .. })),
                "{bad:?} was taken"
            );
        }
    }
}
