//! Network shaping (SODA §V-E): on while a multi-node training job runs, CPU jobs' processes
//! kept classified. Which processes are CPU jobs is handed over by the inference controller
//! (its instances). Touches `tc`/`nft` through `enforce::shaping` and the jobs lent by the tick.

use tracing::info;

use super::{Event, TickCx};
use crate::enforce::network::node::{CpuJob, NetworkControl, NetworkEvent, NetworkWant};
use crate::job::{JobId, Role};

pub(super) struct Network {
    control: NetworkControl,
    /// Shaping steps taken, for Prometheus (with contention's).
    actions: u64,
}

impl Network {
    pub(super) fn new(control: NetworkControl) -> Self {
        Self::with_actions(control, 0)
    }

    /// Taking over the count of shaping steps from the control it replaces (a reload).
    pub(super) fn with_actions(control: NetworkControl, actions: u64) -> Self {
        Self { control, actions }
    }

    pub(super) fn actions(&self) -> u64 {
        self.actions
    }

    pub(super) fn status(&self) -> String {
        self.control.status()
    }

    /// Applies shaping for the multi-node training jobs and the CPU jobs in `cpu_jobs`. Returns
    /// whether a job's view changed.
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>, cpu_jobs: Vec<CpuJob>) -> bool {
        let multi_node: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind.role() == Role::Training && s.job.spec.multi_node)
            .map(|s| s.job.id.clone())
            .collect();
        let want = NetworkWant {
            multi_node,
            cpu_jobs,
        };
        let events = self.control.reconcile(&want);
        let mut changed = false;
        for stored in cx.state.jobs.values_mut() {
            let multi = stored.job.spec.kind.role() == Role::Training && stored.job.spec.multi_node;
            let text = self.control.job_text(&stored.job.id, multi);
            if stored.job.network != text {
                stored.job.network = text;
                changed = true;
            }
        }
        let events = self.events(events);
        cx.events.extend(events);
        changed
    }

    /// A reload replaces this control: its tree goes, the CPU jobs are told they are released.
    pub(super) fn remove_for_replacement(&mut self) -> Vec<Event> {
        let events = self.control.remove_for_replacement();
        self.events(events)
    }

    /// `Throttled` signals (and the Prometheus count) for network shaping steps.
    fn events(&mut self, events: Vec<NetworkEvent>) -> Vec<Event> {
        let level = self.control.held_level();
        events
            .into_iter()
            .map(|e| {
                self.actions += 1;
                match e {
                    NetworkEvent::Held(id) => {
                        info!(job = %id, "network: CPU job held ({level}) while multi-node training runs");
                        Event::Throttled {
                            id,
                            mechanism: "tc".into(),
                            level: level.clone(),
                        }
                    }
                    NetworkEvent::Released(id) => {
                        info!(job = %id, "network: CPU job released");
                        Event::Throttled {
                            id,
                            mechanism: "release".into(),
                            level: "tc".into(),
                        }
                    }
                }
            })
            .collect()
    }
}
