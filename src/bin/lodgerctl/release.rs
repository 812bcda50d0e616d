//! `lodgerctl unregister --all` and `drain`: releasing every job the caller may, and saying
//! what was released and what was skipped.

use lodger::api::proxy::ManagerProxy;

use crate::{from_zbus, get, Failure};

/// What `unregister --all` (and `drain`) did, job by job.
#[derive(Default)]
pub(crate) struct Released {
    pub released: Vec<String>,
    /// Jobs left alone, and why: another user's (a caller who is not root acts only on their
    /// own), or one lodgerd refused.
    pub skipped: Vec<(String, String)>,
    /// The caller's own jobs that could not be released.
    pub failed: Vec<Failure>,
}

impl Released {
    pub fn to_json(&self) -> serde_json::Value {
        let skipped: Vec<_> = self
            .skipped
            .iter()
            .map(|(id, why)| serde_json::json!({ "id": id, "reason": why }))
            .collect();
        serde_json::json!({ "unregistered": self.released, "skipped": skipped })
    }

    /// A failure when one of the caller's own jobs could not be released (the first one's exit
    /// code, every message).
    pub fn result(&mut self) -> Result<(), Failure> {
        let Some(code) = self.failed.first().map(|f| f.code) else {
            return Ok(());
        };
        let messages: Vec<String> = std::mem::take(&mut self.failed)
            .into_iter()
            .map(|f| f.message)
            .collect();
        Err(Failure {
            code,
            message: messages.join("; "),
        })
    }
}

/// Unregisters every job `caller` may: all of them for root, the caller's own for anyone else
/// (another user's would be refused). Goes on past a job it cannot release, so that one job
/// does not keep the rest registered; a job that ended meanwhile is skipped silently.
pub(crate) async fn unregister_all(
    proxy: &ManagerProxy<'_>,
    action: &str,
    caller: u32,
) -> Released {
    let mut done = Released::default();
    let jobs = match proxy.list_jobs().await {
        Ok(jobs) => jobs,
        Err(e) => {
            done.failed.push(from_zbus(action, e));
            return done;
        }
    };
    let gone = |e: &zbus::Error| matches!(e, zbus::Error::MethodError(name, ..) if name.as_str() == "org.lodger1.Error.NotFound");
    for (id, ..) in jobs {
        if caller != 0 {
            match proxy.get_job(&id).await {
                Ok(job) => {
                    let owner = get(&job, "owner_uid");
                    if owner != caller.to_string() {
                        done.skipped.push((id, format!("belongs to uid {owner}")));
                        continue;
                    }
                }
                Err(e) if gone(&e) => continue,
                Err(e) => {
                    done.failed.push(from_zbus(&format!("unregister {id}"), e));
                    continue;
                }
            }
        }
        match proxy.unregister_job(&id).await {
            Ok(()) => done.released.push(id),
            Err(e) if gone(&e) => {}
            Err(zbus::Error::MethodError(name, msg, _))
                if name.as_str() == "org.lodger1.Error.AccessDenied" =>
            {
                let why = msg.unwrap_or_else(|| "access denied".into());
                done.skipped.push((id, crate::render::printable(&why)));
            }
            Err(e) => done.failed.push(from_zbus(&format!("unregister {id}"), e)),
        }
    }
    done
}
