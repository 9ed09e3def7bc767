//! Where the time of a step goes: named phases timed with device events (host clocks on the CPU), so every claim
//! about a phase's cost is a measurement. Model code marks phases with [`span`]; the marks cost one thread-local
//! check unless a [`Recorder`] is active on the calling thread.
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

use tch::Device;

use crate::device::{DeviceError, TimingEvent, synchronize};

enum Mark {
    Event(TimingEvent),
    Host(Instant),
}

struct Active {
    device: Device,
    spans: Vec<(&'static str, Mark, Option<Mark>)>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

fn mark(device: Device) -> Mark {
    match TimingEvent::new(device) {
        Ok(Some(ev)) if ev.record().is_ok() => Mark::Event(ev),
        _ => Mark::Host(Instant::now()),
    }
}

/// Marks the end of a phase when dropped.
pub struct Span {
    index: Option<usize>,
}

/// Starts phase `name` on this thread; it ends when the returned guard drops. A no-op unless recording.
pub fn span(name: &'static str) -> Span {
    let index = ACTIVE.with(|a| {
        let mut a = a.borrow_mut();
        let active = a.as_mut()?;
        let start = mark(active.device);
        active.spans.push((name, start, None));
        Some(active.spans.len() - 1)
    });
    Span { index }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(i) = self.index else { return };
        ACTIVE.with(|a| {
            if let Some(active) = a.borrow_mut().as_mut() {
                active.spans[i].2 = Some(mark(active.device));
            }
        });
    }
}

/// Records the phases of the calling thread's work on `device` from `start` until `finish`.
pub struct Recorder {
    device: Device,
}

impl Recorder {
    pub fn start(device: Device) -> Self {
        ACTIVE.with(|a| *a.borrow_mut() = Some(Active { device, spans: Vec::new() }));
        Recorder { device }
    }

    /// Waits for the device and returns the milliseconds spent in each phase, summed over its spans.
    pub fn finish(self) -> Result<BTreeMap<&'static str, f64>, DeviceError> {
        synchronize(self.device)?;
        let active = ACTIVE.with(|a| a.borrow_mut().take());
        let mut totals = BTreeMap::new();
        for (name, start, end) in active.map(|a| a.spans).unwrap_or_default() {
            let ms = match (start, end) {
                (Mark::Event(s), Some(Mark::Event(e))) => s.elapsed_ms(&e)?,
                (Mark::Host(s), Some(Mark::Host(e))) => (e - s).as_secs_f64() * 1e3,
                _ => continue,
            };
            *totals.entry(name).or_insert(0.0) += ms;
        }
        Ok(totals)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_sum_per_phase_and_cost_nothing_when_idle() {
        drop(span("ignored")); // no recorder: a no-op
        let rec = Recorder::start(Device::Cpu);
        for _ in 0..3 {
            let _s = span("sleep");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        drop(span("instant"));
        let phases = rec.finish().unwrap();
        assert!(phases["sleep"] >= 6.0, "{phases:?}");
        assert!(phases["instant"] < phases["sleep"]);
        assert!(!phases.contains_key("ignored"));
    }
}
