//! The run's recent events for the live page (`GET /history`): the last [`KEPT`] log events dflash wrote at the log's
//! level (restarts, rewinds, reloads, checkpoints, evaluations, exports, hosts joining and leaving, problems), as
//! text lines have them. The progress lines (target `dflash::progress`) and the per-step lines (`dflash::steps`)
//! are the page's charts, not its events.
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};

use serde::Serialize;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;

/// Events kept.
pub const KEPT: usize = 200;

/// Targets whose events are not the page's events.
const CHARTED: [&str; 2] = ["dflash::progress", "dflash::steps"];

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LoggedEvent {
    pub time: String,
    pub level: String,
    /// The message, then its fields as `name=value`.
    pub text: String,
}

fn kept() -> &'static Mutex<VecDeque<LoggedEvent>> {
    static KEPT_EVENTS: OnceLock<Mutex<VecDeque<LoggedEvent>>> = OnceLock::new();
    KEPT_EVENTS.get_or_init(|| Mutex::new(VecDeque::with_capacity(KEPT)))
}

/// The events kept, oldest first.
pub fn events() -> Vec<LoggedEvent> {
    kept().lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
}

/// Keeps dflash's events of level INFO and above, after the log's filter.
pub struct RecentEvents;

impl<S: Subscriber> Layer<S> for RecentEvents {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let target = meta.target();
        if *meta.level() > Level::INFO || !target.starts_with("dflash") || CHARTED.contains(&target) {
            return;
        }
        let mut text = Text::default();
        event.record(&mut text);
        let line = LoggedEvent {
            time: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
            level: meta.level().to_string(),
            text: text.line(),
        };
        let mut kept = kept().lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() == KEPT {
            kept.pop_front();
        }
        kept.push_back(line);
    }
}

/// An event's message and fields as one line.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Text {
    fn line(self) -> String {
        match self.fields.is_empty() {
            true => self.message,
            false => format!("{}{}", self.message, self.fields),
        }
    }
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            name => {
                let _ = write!(self.fields, " {name}={value}");
            }
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            name => {
                let _ = write!(self.fields, " {name}={value:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// The kept events are dflash's, at INFO and above, without the charted lines, each with its fields; the
    /// oldest go first once [`KEPT`] are kept.
    #[test]
    fn keeps_the_runs_events_and_not_its_charted_lines() {
        let subscriber = tracing_subscriber::registry().with(RecentEvents);
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(target: "dflash::service::supervisor", drafter = 1, "drafter failed: injected");
            tracing::info!(target: "dflash::progress", "step 10 · epoch 0");
            tracing::debug!(target: "dflash::steps", step = 10, "step committed");
            tracing::debug!(target: "dflash::service", "a debug line");
            tracing::warn!(target: "hyper::proto", "a dependency's line");
            tracing::warn!(target: "dflash::service::run", path = "runs/x", "rewinding to the newest valid checkpoint");
        });
        let texts: Vec<(String, String)> = events().into_iter().map(|e| (e.level, e.text)).collect();
        let ours: Vec<&(String, String)> = texts.iter().filter(|(_, t)| !t.starts_with("filler")).collect();
        assert_eq!(
            ours,
            [
                &("INFO".to_string(), "drafter failed: injected drafter=1".to_string()),
                &("WARN".to_string(), "rewinding to the newest valid checkpoint path=runs/x".to_string())
            ]
        );
        let subscriber = tracing_subscriber::registry().with(RecentEvents);
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..KEPT {
                tracing::info!(target: "dflash::test", "filler {i}");
            }
        });
        let after = events();
        assert_eq!(after.len(), KEPT);
        assert_eq!(after[0].text, "filler 0");
        assert_eq!(after[KEPT - 1].text, format!("filler {}", KEPT - 1));
    }
}
