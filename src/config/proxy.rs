//! `[proxy]`: what `dflash proxy` records and keeps (docs/data.md, "What your users ask"). In the same file as the run's
//! other settings, so that one TOML names the recording folder for the proxy and for the training that reads it;
//! serve-train ignores the section, and a reload or a resume does not compare it.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, invalid};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProxy {
    upstream: String,
    listen: String,
    record: String,
    segment_bytes: i64,
    segment_seconds: i64,
    queue: i64,
    keep_bytes: i64,
    keep_hours: f64,
    skip_headers: Vec<String>,
    redact: Vec<RawRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    pattern: String,
    #[serde(default)]
    replace: Option<String>,
    #[serde(default)]
    drop: bool,
}

/// One redaction rule: what matches `pattern` is replaced by `replace`, or with `replace` `None` the exchange is not
/// recorded.
#[derive(Debug, Clone)]
pub struct RedactRule {
    pub pattern: regex::Regex,
    pub replace: Option<String>,
}

impl PartialEq for RedactRule {
    fn eq(&self, other: &Self) -> bool {
        (self.pattern.as_str(), &self.replace) == (other.pattern.as_str(), &other.replace)
    }
}

/// The validated `[proxy]` section.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// The served target's base URL; `None` until given (here or by `--upstream`).
    pub upstream: Option<String>,
    pub listen: SocketAddr,
    pub record: PathBuf,
    /// A segment is sealed at this size or age.
    pub segment_bytes: u64,
    pub segment_age: Duration,
    /// Sealed segments past these are deleted, oldest first (`None`: no bound).
    pub keep_bytes: Option<u64>,
    pub keep_age: Option<Duration>,
    pub queue: usize,
    /// Request headers (lower case) that keep an exchange out of the recording.
    pub skip_headers: Vec<String>,
    pub redact: Vec<RedactRule>,
}

/// The served target's base URL as `key` (`proxy.upstream`, `--upstream`) gives it: `None` for an empty one.
pub fn upstream_url(key: &str, value: &str) -> Result<Option<String>, ConfigError> {
    match value.trim() {
        "" => Ok(None),
        u if u.starts_with("http://") || u.starts_with("https://") => Ok(Some(u.to_string())),
        u => Err(invalid(key, format!("{u:?}"), "an http:// or https:// URL, e.g. http://localhost:8000")),
    }
}

impl RawProxy {
    pub(super) fn validate(self) -> Result<ProxyConfig, ConfigError> {
        let upstream = upstream_url("proxy.upstream", &self.upstream)?;
        let listen = self.listen.parse().map_err(|_| {
            invalid("proxy.listen", format!("{:?}", self.listen), "an address and port, e.g. 127.0.0.1:8001")
        })?;
        if self.record.trim().is_empty() {
            return Err(invalid("proxy.record", "\"\"", "the recording folder, e.g. \"traffic\""));
        }
        let positive = |key: &str, v: i64| {
            u64::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| invalid(key, v, "a whole number above 0"))
        };
        let at_least_0 = |key: &str, v: i64| u64::try_from(v).map_err(|_| invalid(key, v, "0 (no bound) or more"));
        if !(self.keep_hours.is_finite() && self.keep_hours >= 0.0) {
            return Err(invalid("proxy.keep_hours", self.keep_hours, "0 (no bound) or more hours"));
        }
        let keep_bytes = at_least_0("proxy.keep_bytes", self.keep_bytes)?;
        let mut rules = Vec::with_capacity(self.redact.len());
        for (i, rule) in self.redact.into_iter().enumerate() {
            let key = format!("proxy.redact[{i}]");
            let pattern = regex::Regex::new(&rule.pattern).map_err(|e| {
                invalid(&format!("{key}.pattern"), format!("{:?}", rule.pattern), format!("a regular expression: {e}"))
            })?;
            let replace = match (rule.replace, rule.drop) {
                (Some(with), false) => Some(with),
                (None, true) => None,
                _ => {
                    return Err(invalid(
                        &key,
                        format!("pattern {:?}", rule.pattern),
                        "either replace = \"TEXT\" (mask what matches) or drop = true (record nothing of the exchange)",
                    ));
                }
            };
            rules.push(RedactRule { pattern, replace });
        }
        Ok(ProxyConfig {
            upstream,
            listen,
            record: PathBuf::from(self.record),
            segment_bytes: positive("proxy.segment_bytes", self.segment_bytes)?,
            segment_age: Duration::from_secs(positive("proxy.segment_seconds", self.segment_seconds)?),
            keep_bytes: (keep_bytes > 0).then_some(keep_bytes),
            keep_age: (self.keep_hours > 0.0).then(|| Duration::from_secs_f64(self.keep_hours * 3600.0)),
            queue: positive("proxy.queue", self.queue)? as usize,
            skip_headers: self.skip_headers.iter().map(|h| h.trim().to_ascii_lowercase()).collect(),
            redact: rules,
        })
    }
}
