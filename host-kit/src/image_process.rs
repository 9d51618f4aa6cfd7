//! What a sandbox of an image runs, from the image's config and the spec: the same for every
//! driver that runs images (`oci` in a container, `vm` in its guest).

use sbx_driver_api::DriverError;
use sbx_images::{ImageConfig, ImageError, ImageInfo, ImageStore};

/// The image a create names by its manifest digest, which must be in the store: an
/// `InvalidArgument` saying so otherwise.
pub fn stored_image(store: &ImageStore, digest: &str) -> Result<ImageInfo, DriverError> {
    store.get(digest).map_err(|e| match e {
        ImageError::NotFound { .. } => DriverError::InvalidArgument(format!(
            "image {digest} is not in the image store at {}",
            store.root().display()
        )),
        other => DriverError::InvalidArgument(format!("image {digest}: {other}")),
    })
}

/// PATH when neither the image nor the spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The main process of a sandbox of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageProcess {
    /// The spec's command, else the image's Entrypoint + Cmd.
    pub args: Vec<String>,
    /// `KEY=value`: a default PATH and HOSTNAME, the image's Env over them, the spec's
    /// variables (in name order) over those.
    pub env: Vec<String>,
    /// The image's WorkingDir, else `/`.
    pub cwd: String,
    /// The image's User, unresolved (names are looked up in the sandbox's own root).
    pub user: String,
}

impl ImageProcess {
    /// Checks the process as a spec's command is checked (`image` names the image in the
    /// error when the process has no command at all), and gives its environment as pairs.
    pub fn validate(&self, image: &str) -> Result<Vec<(String, String)>, DriverError> {
        let env: Vec<(String, String)> = self
            .env
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.clone(), String::new()),
            })
            .collect();
        crate::validate_command("the spec", &self.args, env.iter().map(|(k, v)| (k, v))).map_err(
            |e| match self.args.is_empty() {
                true => DriverError::InvalidArgument(format!(
                    "the spec has no command and image {image} has no Entrypoint or Cmd: give \
                     a command"
                )),
                false => e,
            },
        )?;
        Ok(env)
    }
}

/// The main process of a sandbox of an image with this config, this spec command and
/// environment, and this hostname.
pub fn image_process<'a>(
    config: &ImageConfig,
    command: &[String],
    spec_env: impl IntoIterator<Item = (&'a String, &'a String)>,
    hostname: &str,
) -> ImageProcess {
    let args = if command.is_empty() {
        config
            .entrypoint
            .iter()
            .chain(&config.cmd)
            .cloned()
            .collect()
    } else {
        command.to_vec()
    };
    let mut env: Vec<(String, String)> = Vec::new();
    let mut set = |key: &str, value: &str| match env.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value.to_string(),
        None => env.push((key.to_string(), value.to_string())),
    };
    set("PATH", DEFAULT_PATH);
    set("HOSTNAME", hostname);
    for kv in &config.env {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        set(k, v);
    }
    let mut spec_env: Vec<(&String, &String)> = spec_env.into_iter().collect();
    spec_env.sort();
    for (k, v) in spec_env {
        set(k, v);
    }
    ImageProcess {
        args,
        env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        cwd: if config.working_dir.is_empty() {
            "/".to_string()
        } else {
            config.working_dir.clone()
        },
        user: config.user.clone(),
    }
}
