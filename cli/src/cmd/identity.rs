//! `sbx identity …`: IdentityService, for a gateway-wide admin — `sbxd token` from
//! anywhere the gateway can be reached.

use clap::{Args, Subcommand};
use sbx_proto::v1::identity_service_client::IdentityServiceClient;
use sbx_proto::v1::{
    CreateIdentityRequest, Identity, ListIdentitiesRequest, RevokeIdentityRequest,
};

use crate::CliError;
use crate::connect::{Target, connect};
use crate::reply::print;

/// `sbx identity …`
#[derive(Debug, Subcommand)]
pub enum IdentityCommand {
    /// Make an identity; its token is printed alone on the last line of stdout, once (the
    /// gateway keeps only its hash).
    Create(IdentityCreateArgs),
    /// The identities: name, role, workspaces, credential, expiry (never a secret).
    #[command(visible_alias = "ls")]
    List,
    /// Remove an identity: its token and its certificate stop working at the next call.
    #[command(visible_alias = "rm")]
    Revoke(IdentityRevokeArgs),
}

#[derive(Debug, Args)]
pub struct IdentityCreateArgs {
    /// The identity's name (a DNS-1123 label); also its client certificate's common name.
    pub name: String,
    /// viewer, editor or admin.
    #[arg(long, value_parser = ["viewer", "editor", "admin"])]
    pub role: String,
    /// A workspace the role holds in; repeat for several. None: every workspace.
    #[arg(long = "workspace", short = 'w', value_name = "WORKSPACE")]
    pub workspaces: Vec<String>,
    /// Seconds until it expires (default: until revoked).
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// No token: a client certificate with this name is its credential.
    #[arg(long)]
    pub cert_only: bool,
    /// The token in E2B's API-key form (`e2b_` + 40 hex digits), for the E2B SDKs against
    /// `sbxd serve --e2b-listen`; it works as any other token.
    #[arg(long, conflicts_with = "cert_only")]
    pub e2b: bool,
}

#[derive(Debug, Args)]
pub struct IdentityRevokeArgs {
    pub name: String,
}

fn describe(id: &Identity) -> String {
    let scope = if id.workspaces.is_empty() {
        "every workspace".to_string()
    } else {
        id.workspaces.join(",")
    };
    let expires = crate::output::rfc3339(id.expires_at.as_ref()).unwrap_or_else(|| "never".into());
    format!(
        "{}\t{}\t{scope}\t{}\t{expires}",
        id.name,
        id.role,
        if id.has_token { "token" } else { "certificate" }
    )
}

pub async fn run_identity(target: &Target, cmd: IdentityCommand) -> Result<u8, CliError> {
    let mut client = IdentityServiceClient::new(connect(target).await?);
    match cmd {
        IdentityCommand::Create(args) => {
            let made = client
                .create_identity(CreateIdentityRequest {
                    name: args.name,
                    role: args.role,
                    workspaces: args.workspaces,
                    ttl_seconds: args.ttl.unwrap_or(0),
                    cert_only: args.cert_only,
                    e2b_key: args.e2b,
                })
                .await?
                .into_inner();
            if let Some(id) = &made.identity {
                eprintln!("identity made: {}", describe(id).replace('\t', " "));
            }
            if !made.token.is_empty() {
                eprintln!("its token (shown only now; give it as SBX_TOKEN or --token):");
                print(&format!("{}\n", made.token))?;
            }
        }
        IdentityCommand::List => {
            let listed = client
                .list_identities(ListIdentitiesRequest {})
                .await?
                .into_inner()
                .identities;
            let mut text = String::from("NAME\tROLE\tWORKSPACES\tCREDENTIAL\tEXPIRES\n");
            for id in &listed {
                text.push_str(&describe(id));
                text.push('\n');
            }
            print(&text)?;
        }
        IdentityCommand::Revoke(args) => {
            let gone = client
                .revoke_identity(RevokeIdentityRequest { name: args.name })
                .await?
                .into_inner();
            if let Some(id) = &gone.identity {
                eprintln!("identity revoked: {}", describe(id).replace('\t', " "));
            }
        }
    }
    Ok(0)
}
