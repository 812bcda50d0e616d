//! D-Bus errors (`org.lodger1.Error.*`) and the one function that maps agent errors onto them.

use crate::agent::AgentError;

/// Every error a lodger D-Bus method can return. The message is one sentence a person can act on.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.lodger1.Error")]
pub enum ApiError {
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The spec is malformed or names something that does not exist.
    InvalidSpec(String),
    /// Not enough free CPUs for the request.
    NoCapacity(String),
    /// No job with that id.
    NotFound(String),
    /// The caller may not make this call.
    AccessDenied(String),
    /// The request clashes with a registered job.
    Conflict(String),
    /// The kernel refused a change (cgroup, scheduling policy); the message says which file or
    /// setting to look at.
    EnforcementFailed(String),
    /// lodgerd could not do its own bookkeeping (state file) or is stopping.
    Failed(String),
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        let msg = e.to_string();
        match e {
            AgentError::InvalidSpec(_) => ApiError::InvalidSpec(msg),
            AgentError::NoCapacity(_) => ApiError::NoCapacity(msg),
            AgentError::NotFound(_) => ApiError::NotFound(msg),
            AgentError::Conflict(_) => ApiError::Conflict(msg),
            AgentError::AccessDenied(_) => ApiError::AccessDenied(msg),
            AgentError::Enforce(_) => ApiError::EnforcementFailed(msg),
            AgentError::Store(_) | AgentError::Stopped => ApiError::Failed(msg),
        }
    }
}
