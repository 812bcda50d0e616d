//! Client-side proxies of lodger's D-Bus interfaces, used by `lodgerctl` and the tests.

use std::collections::HashMap;

use zbus::proxy;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};

#[proxy(
    interface = "org.lodger1.Manager",
    default_service = "org.lodger1",
    default_path = "/org/lodger1"
)]
pub trait Manager {
    fn register_job(
        &self,
        spec: HashMap<&str, Value<'_>>,
    ) -> zbus::Result<(String, OwnedObjectPath)>;
    fn unregister_job(&self, id: &str) -> zbus::Result<()>;
    fn list_jobs(&self) -> zbus::Result<Vec<(String, String, String, OwnedObjectPath)>>;
    fn get_job(&self, id: &str) -> zbus::Result<HashMap<String, OwnedValue>>;
    fn get_status(&self) -> zbus::Result<HashMap<String, OwnedValue>>;
    #[allow(clippy::type_complexity)]
    fn get_observations(
        &self,
    ) -> zbus::Result<(
        HashMap<String, OwnedValue>,
        HashMap<String, HashMap<String, OwnedValue>>,
        HashMap<String, String>,
    )>;
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn free(&self) -> zbus::Result<String>;
    #[zbus(signal)]
    fn job_changed(&self, id: String, state: String) -> zbus::Result<()>;
    #[zbus(signal)]
    fn throttled(&self, job: String, mechanism: String, level: String) -> zbus::Result<()>;
}
