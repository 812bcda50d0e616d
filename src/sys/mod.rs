//! The kernel vocabularies that sensing and enforcement share: how `/proc` and resctrl are laid
//! out, read and written. Each module takes its root (`/proc`, `/sys/fs/resctrl`) as an
//! argument; nothing here imports `sense`, `policy`, `enforce` or `agent`.

pub mod procfs;
pub mod resctrlfs;
