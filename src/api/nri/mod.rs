//! Kubernetes through NRI (docs/kubernetes.md): lodgerd connects to the container runtime's NRI
//! socket, serves NRI's `Plugin` service and calls its `Runtime` service over the two
//! connections NRI multiplexes on that socket, and connects again whenever the runtime
//! restarts. Touches the NRI socket; jobs change only through the agent's handle.

pub mod mux;
pub mod plugin;
pub mod pods;
pub mod proto;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream;
use tokio::net::UnixStream;
use tracing::{info, warn};
use ttrpc::r#async::transport::{Listener, Socket};
use ttrpc::r#async::{Client, Server};

use self::mux::{Mux, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN};
pub use self::plugin::{NriPlugin, TrainingSched};
use self::proto::api_ttrpc::{create_plugin, RuntimeClient};
use self::proto::RegisterPluginRequest;
use crate::agent::AgentHandle;
use crate::config::KubernetesConfig;

/// The name lodger registers under; the runtime logs it as `<index>-lodger`.
pub const PLUGIN_NAME: &str = "lodger";
/// How long the runtime has to answer the registration.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// Waits between connection attempts: doubling from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_LAST: Duration = Duration::from_secs(30);

/// Runs the plugin for as long as lodgerd runs: connects, serves until the runtime closes the
/// connection, and connects again. Says once that the socket cannot be reached, and again when
/// it can.
pub async fn run(agent: AgentHandle, config: KubernetesConfig, sched: TrainingSched) {
    let socket = config.nri_socket.clone();
    let index = config.plugin_index.clone();
    let plugin = Arc::new(NriPlugin::new(agent, config, sched));
    let mut wait = RETRY_FIRST;
    let mut unreachable = false;
    loop {
        match serve_once(&plugin, &socket, &index).await {
            Ok(why) => {
                info!("NRI: the runtime closed the connection ({why}); connecting again");
                wait = RETRY_FIRST;
                unreachable = false;
            }
            Err(e) => {
                if !unreachable {
                    warn!(
                        "NRI: cannot join the runtime at {}: {e}; trying again every {} s at \
                         most (is NRI enabled in the runtime's config? docs/kubernetes.md)",
                        socket.display(),
                        RETRY_LAST.as_secs()
                    );
                    unreachable = true;
                }
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RETRY_LAST);
    }
}

/// One connection: registers and serves until the runtime goes. `Ok(why it ended)` once
/// registered; `Err` when it could not get that far.
async fn serve_once(
    plugin: &Arc<NriPlugin>,
    socket: &std::path::Path,
    index: &str,
) -> io::Result<String> {
    let trunk = UnixStream::connect(socket).await?;
    let mut mux = Mux::new(trunk, &[PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN]);
    let (Some(ours), Some(theirs)) = (
        mux.take(PLUGIN_SERVICE_CONN),
        mux.take(RUNTIME_SERVICE_CONN),
    ) else {
        return Err(io::Error::other("the multiplexer lost a connection"));
    };
    // Serve before registering: the runtime configures the plugin while registering it.
    let mut server = Server::new()
        .register_service(create_plugin(Arc::clone(plugin) as _))
        .add_listener(Listener::new(stream::StreamExt::chain(
            stream::once(async move { Ok(ours) }),
            stream::pending(),
        )));
    server.start().await.map_err(io::Error::other)?;
    let runtime = RuntimeClient::new(Client::new(Socket::new(theirs)));
    let mut req = RegisterPluginRequest::new();
    req.plugin_name = PLUGIN_NAME.into();
    req.plugin_idx = index.into();
    let timeout = i64::try_from(REGISTER_TIMEOUT.as_nanos()).unwrap_or(i64::MAX);
    let registered = runtime
        .register_plugin(ttrpc::context::with_timeout(timeout), &req)
        .await;
    let result = match registered {
        Ok(_) => {
            info!(
                "NRI: registered with the runtime at {} as plugin {index}-{PLUGIN_NAME}",
                socket.display()
            );
            Ok(mux.closed().await.to_string())
        }
        Err(e) => Err(io::Error::other(format!("registration refused: {e}"))),
    };
    let _ = server.shutdown().await;
    result
}
