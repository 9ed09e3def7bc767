//! Structured logs on stderr (`tracing`), text or JSON, filtered by `log.level` unless `RUST_LOG` is set; the
//! filter can be swapped while running (a reloaded `log.level`).
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
        LogFormat::Text => registry.with(fmt::layer().with_writer(std::io::stderr)).try_init(),
        LogFormat::Json => registry.with(fmt::layer().json().with_writer(std::io::stderr)).try_init(),
    };
    installed.map_err(|_| LoggingError::AlreadySet)?;
    let _ = FILTER.set(handle);
    let _ = PINNED_BY_ENV.set(pinned);
    Ok(())
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
