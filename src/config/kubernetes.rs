//! config::kubernetes: `[kubernetes]`: whether lodgerd joins the container runtime as an NRI
//! plugin, where the runtime's socket is, and what it makes of containers no annotation names
//! (docs/kubernetes.md). Touches no file.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{named_enum, one_of};
use super::{ConfigError, Cx};

named_enum! {
    /// What the NRI plugin makes of a container that asks for GPUs and carries no
    /// `lodger.dev/kind` annotation.
    GpuContainers {
        Training => "training",
        /// Left alone, like every other unannotated container.
        Leave => "leave",
    }
}

/// `[kubernetes]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KubernetesConfig {
    /// Connect to the container runtime as an NRI plugin.
    pub nri: bool,
    /// The runtime's NRI socket.
    pub nri_socket: PathBuf,
    /// The plugin's index: the runtime calls plugins in ascending order (two digits).
    pub plugin_index: String,
    pub gpu_containers: GpuContainers,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            nri: false,
            nri_socket: PathBuf::from("/var/run/nri/nri.sock"),
            plugin_index: "50".into(),
            gpu_containers: GpuContainers::Training,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawKubernetes {
    nri: Option<Spanned<bool>>,
    nri_socket: Option<Spanned<String>>,
    plugin_index: Option<Spanned<String>>,
    gpu_containers: Option<Spanned<String>>,
}

impl Cx<'_> {
    pub(super) fn kubernetes(
        &mut self,
        raw: Option<RawKubernetes>,
    ) -> Result<KubernetesConfig, ConfigError> {
        let d = KubernetesConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(KubernetesConfig {
            nri: self.field("kubernetes.nri", raw.nri, d.nri, Ok)?,
            nri_socket: self.field("kubernetes.nri_socket", raw.nri_socket, d.nri_socket, |s| {
                if s.starts_with('/') && !s.contains('\0') {
                    Ok(PathBuf::from(s))
                } else {
                    Err(format!("\"{s}\" is not an absolute path to a socket"))
                }
            })?,
            plugin_index: self.field(
                "kubernetes.plugin_index",
                raw.plugin_index,
                d.plugin_index,
                |s| {
                    if s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()) {
                        Ok(s)
                    } else {
                        Err(format!("\"{s}\" is not two digits, e.g. \"50\""))
                    }
                },
            )?,
            gpu_containers: self.field(
                "kubernetes.gpu_containers",
                raw.gpu_containers,
                d.gpu_containers,
                |s| one_of(&s, GpuContainers::from_name, GpuContainers::NAMES),
            )?,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::tests::{parse, refused};
    use crate::config::GpuContainers;
    use std::path::Path;

    #[test]
    fn the_section_is_read_and_bad_values_named() {
        let c = parse(
            "[kubernetes]\nnri = true\nnri_socket = \"/run/nri/nri.sock\"\n\
             plugin_index = \"07\"\ngpu_containers = \"leave\"\n",
        )
        .unwrap();
        assert!(c.kubernetes.nri);
        assert_eq!(c.kubernetes.nri_socket, Path::new("/run/nri/nri.sock"));
        assert_eq!(c.kubernetes.plugin_index, "07");
        assert_eq!(c.kubernetes.gpu_containers, GpuContainers::Leave);
        for (text, says) in [
            (
                "[kubernetes]\nnri_socket = \"nri.sock\"\n",
                "kubernetes.nri_socket",
            ),
            (
                "[kubernetes]\nplugin_index = \"5\"\n",
                "kubernetes.plugin_index",
            ),
            (
                "[kubernetes]\nplugin_index = \"ab\"\n",
                "kubernetes.plugin_index",
            ),
            (
                "[kubernetes]\ngpu_containers = \"batch\"\n",
                "kubernetes.gpu_containers",
            ),
            ("[kubernetes]\nnri = \"yes\"\n", "kubernetes"),
        ] {
            let err = refused(text);
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
