//! Structured logs on stderr (`tracing`), text or JSON, filtered by `log.level` unless `RUST_LOG` is set; the
//! filter can be swapped while running (a reloaded `log.level`). Text is coloured only on a terminal: logs sent to a
//! file, a pipe, journald or `docker logs` stay plain, and `NO_COLOR` turns colours off everywhere.
use std::ffi::OsStr;
use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
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
    let registry = tracing_subscriber::registry().with(filter);
    let installed = match settings.format {
        LogFormat::Text => {
            let ansi = colour(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
            registry.with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr)).try_init()
        }
        LogFormat::Json => registry.with(fmt::layer().json().with_writer(std::io::stderr)).try_init(),
    };
    installed.map_err(|_| LoggingError::AlreadySet)?;
    let _ = FILTER.set(handle);
    let _ = PINNED_BY_ENV.set(pinned);
    Ok(())
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

    #[test]
    fn colours_only_on_a_terminal_and_never_with_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a file or pipe gets plain text");
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(colour(true, Some(OsStr::new(""))), "an empty NO_COLOR does not count (no-color.org)");
    }
}
