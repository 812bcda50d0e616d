//! A config reload reaching the loop: the settings that may change while jobs run
//! ([`LiveSettings`], chosen by `config::reload`) applied between two ticks. Jobs, plans and
//! searches under way are kept; a controller switched off gives back what it holds.

use tracing::info;

use super::contention::Contention;
use super::network::Network;
use super::rtguard::RtGuard;
use super::{Agent, LiveSettings, NetworkReload};
use crate::policy::contention::HeldContention;

impl Agent {
    /// Applies `live` from the next tick on.
    ///
    /// - interval and `[rightsize]`: a search under way keeps the window it started with; the
    ///   mode applies from the next tick.
    /// - `[contention]`: thresholds, tick counts and the mode apply from the next sensing pass,
    ///   throttles in force and learnt stable levels are kept (advise lifts what is applied);
    ///   switched off, every throttle is given back (cores at the next placement, MBA at once);
    ///   switched on, detection starts learning from the next pass.
    /// - the RT guard's headroom: from the next tick; the cores it added stay.
    /// - `[api]`'s trust settings: from the next call.
    /// - sensing's interval and deadline: from each source's next pass.
    pub(super) fn reload(&mut self, live: LiveSettings) {
        if let (Some((interval, deadline)), Some(sensor)) = (live.sense_pace, &self.sensor) {
            sensor.pace.set(interval, deadline);
        }
        self.settings.interval = live.interval;
        self.settings.rightsize = live.rightsize.clone();
        self.rightsize = super::rightsize::Rightsize::new(live.rightsize);
        match (self.contention.take(), live.contention.clone()) {
            (Some(mut running), Some(config)) => {
                running.reconfigure(config);
                self.contention = Some(running);
            }
            (None, Some(config)) => {
                info!("contention control on ({})", config.mode.as_str());
                // Learns from the next pass: nothing was held while it was off.
                self.state.contention = HeldContention::default();
                self.contention = Some(Contention::new(
                    config,
                    self.idle_mba.take(),
                    &HeldContention::default(),
                ));
            }
            (Some(running), None) => {
                self.idle_mba = running.into_mba();
                let mut released = 0;
                for stored in self.state.jobs.values_mut() {
                    released += usize::from(stored.job.throttle.take().is_some());
                }
                self.state.contention = HeldContention::default();
                info!("contention control off: {released} throttled job(s) given back");
            }
            (None, None) => {}
        }
        self.settings.contention = live.contention;
        self.rt_guard = match (self.rt_guard.take(), live.rt_headroom_percent) {
            (Some(mut guard), Some(headroom)) => {
                guard.set_headroom(headroom);
                Some(guard)
            }
            (None, Some(headroom)) => Some(RtGuard::new(headroom)),
            (_, None) => None,
        };
        self.settings.rt_headroom_percent = live.rt_headroom_percent;
        self.settings.trust = live.trust;
    }

    /// A changed `[network]`: the shaping in place is removed (its CPU jobs told they are
    /// released) and the new control, if any, applies from the next tick, as at a start.
    pub(super) fn reload_network(&mut self, network: NetworkReload) {
        let NetworkReload::Replace(control) = network else {
            return;
        };
        let mut actions = 0;
        if let Some(mut old) = self.network.take() {
            for e in old.remove_for_replacement() {
                self.emit(e);
            }
            actions = old.actions();
        }
        for stored in self.state.jobs.values_mut() {
            stored.job.network = None;
        }
        self.network = control.map(|c| {
            info!("network shaping reconfigured: {}", c.status());
            Network::with_actions(*c, actions)
        });
        if self.network.is_none() {
            info!("network shaping off");
        }
    }
}
