//! Structured logs on stderr (`tracing`), text or JSON, filtered by `log.level` unless `RUST_LOG` is set; the
//! filter can be swapped while running (a reloaded `log.level`). Text is coloured only on a terminal: logs sent to a
//! file, a pipe, journald or `docker logs` stay plain, and `NO_COLOR` turns colours off everywhere. Text lines are
//! short (time, level, message, fields); the module path and the actor's span come with them only at a debug level
//! or with `RUST_LOG` (JSON logs always carry both).
use std::ffi::OsStr;
use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, fmt, reload};

use crate::config::{LogFormat, LogSettings};

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();
static PINNED_BY_ENV: OnceLock<bool> = OnceLock::new();

#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("RUST_LOG={0:?}: {1}")]
    BadEnv(String, String),
    #[error("log.level = {0:?}: {1}")]
    BadLevel(String, String),
    #[error("logging was set up twice")]
    AlreadySet,
}

/// Installs the process's logger (once).
pub fn init(settings: &LogSettings) -> Result<(), LoggingError> {
    let (filter, pinned) = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => {
            (EnvFilter::try_new(&directives).map_err(|e| LoggingError::BadEnv(directives, e.to_string()))?, true)
        }
        _ => (parse(&settings.level)?, false),
    };
    let (filter, handle) = reload::Layer::new(filter);
    // The live page's recent events see what the filter lets through.
    let registry = tracing_subscriber::registry().with(filter).with(super::recent::RecentEvents);
    let installed = match settings.format {
        LogFormat::Text => {
            let ansi = colour(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
            let layer = fmt::layer().with_ansi(ansi).with_writer(std::io::stderr);
            let verbose = pinned || ["debug", "trace"].iter().any(|l| settings.level.to_lowercase().contains(l));
            match verbose {
                true => registry.with(layer).try_init(),
                false => registry.with(layer.event_format(Short { ansi })).try_init(),
            }
        }
        LogFormat::Json => registry.with(fmt::layer().json().with_writer(std::io::stderr)).try_init(),
    };
    installed.map_err(|_| LoggingError::AlreadySet)?;
    let _ = FILTER.set(handle);
    let _ = PINNED_BY_ENV.set(pinned);
    Ok(())
}

/// A text line without the module path and span scope: `2026-12-02T03:30:00.123Z  INFO step 10 · epoch 0 · ...`.
struct Short {
    ansi: bool,
}

impl<S, N> FormatEvent<S, N> for Short
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let time = chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.3fZ");
        let level = *event.metadata().level();
        let colour = match level {
            Level::ERROR => "31",
            Level::WARN => "33",
            Level::INFO => "32",
            Level::DEBUG => "34",
            Level::TRACE => "35",
        };
        match self.ansi {
            true => write!(writer, "{time} \x1b[{colour}m{level:>5}\x1b[0m ")?,
            false => write!(writer, "{time} {level:>5} ")?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Whether text logs are coloured: on a terminal, unless `NO_COLOR` is set to anything but the empty string
/// (no-color.org).
fn colour(terminal: bool, no_color: Option<&OsStr>) -> bool {
    terminal && no_color.is_none_or(OsStr::is_empty)
}

fn parse(level: &str) -> Result<EnvFilter, LoggingError> {
    EnvFilter::try_new(level).map_err(|e| LoggingError::BadLevel(level.to_string(), e.to_string()))
}

/// What a new `log.level` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LevelChange {
    Applied,
    /// `RUST_LOG` is set and wins; the level takes effect only when the service starts without it.
    PinnedByEnv,
    /// No logger was installed through [`init`] (a library caller's own).
    NoLogger,
}

/// Swaps the filter for `level`.
pub fn set_level(level: &str) -> Result<LevelChange, LoggingError> {
    if PINNED_BY_ENV.get().copied().unwrap_or(false) {
        return Ok(LevelChange::PinnedByEnv);
    }
    let Some(handle) = FILTER.get() else {
        return Ok(LevelChange::NoLogger);
    };
    let filter = parse(level)?;
    handle.reload(filter).map_err(|e| LoggingError::BadLevel(level.to_string(), e.to_string()))?;
    Ok(LevelChange::Applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short line keeps the message and its fields, without the module path or the span it was logged in.
    #[test]
    fn short_text_lines_leave_out_the_module_and_the_span() {
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let sink = buffer.clone();
        let layer = fmt::layer().with_ansi(false).with_writer(move || sink.clone()).event_format(Short { ansi: false });
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("Actor", id = "0.0", name = "supervisor");
            let _entered = span.enter();
            tracing::info!(step = 10, "step 10 · epoch 0");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert!(text.trim_end().ends_with(" INFO step 10 · epoch 0 step=10"), "{text}");
        assert!(!text.contains("Actor") && !text.contains("dflash::"), "{text}");
    }

    #[test]
    fn colours_only_on_a_terminal_and_never_with_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a file or pipe gets plain text");
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(colour(true, Some(OsStr::new(""))), "an empty NO_COLOR does not count (no-color.org)");
    }
}
