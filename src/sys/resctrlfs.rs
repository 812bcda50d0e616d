//! resctrl (`/sys/fs/resctrl`): its files, read and written.
