//! `data.stream` in a run: the run's data is the base data (`data.path`) and the waves the stream folder has given
//! ([`crate::data::stream`]), and a thread of its own looks at the folder every `data.stream_poll_s`, makes the next
//! wave when enough has arrived, adds its samples to the run's data and tells the supervisor, whose schedule trains
//! it as the next epoch. A wave is logged before its samples join: a kill in between loses nothing (the restart
//! reads the log and trains the wave).
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::Map;

use crate::cluster::background::Background;
use crate::config::{Config, DataSource};
use crate::data::dataset::Dataset;
use crate::data::loader::StreamEpochs;
use crate::data::prepare::{LongConversations, ModelAssets, PrepareOptions};
use crate::data::shards::{Manifest, PreparedSplit};
use crate::data::stream::{NoSamples, Stream, StreamData, Wave, WaveSettings};
use crate::model::TargetConfig;
use crate::service::supervisor::protocol::Event;

/// The stream's folder under the run's (`checkpoint.dir/stream/`): its log and its waves.
pub fn stream_root(config: &Config) -> PathBuf {
    config.checkpoint.dir.join("stream")
}

/// A run's stream, opened at start.
pub struct StreamRun {
    stream: Stream,
    data: Arc<StreamData>,
    epochs: StreamEpochs,
    assets: ModelAssets,
    settings: WaveSettings,
    poll: Duration,
    vocab_size: usize,
    positions: usize,
}

impl StreamRun {
    /// The stream `config.data.stream` names over the `base` data, with every wave its log lists (checked against
    /// the target as the base data is).
    pub fn open(config: &Config, base: Arc<dyn Dataset>, target: &TargetConfig) -> Result<Option<StreamRun>> {
        let Some(s) = &config.data.stream else { return Ok(None) };
        let what = || format!("data.stream = {}", s.dir.display());
        if !s.dir.is_dir() {
            anyhow::bail!(
                "{}: not a folder; point it at the folder `dflash proxy --record` writes, or create it and drop \
                 chat JSONL files into it",
                what()
            );
        }
        // Waves are rendered as the base data was: with the template settings its folder records (Qwen3's
        // enable_thinking, say).
        let template_kwargs = match &config.data.source {
            DataSource::Prepared(dir) => Manifest::read(dir)
                .ok()
                .and_then(|m| m.settings["template_kwargs"].as_object().cloned())
                .unwrap_or_default(),
            _ => Map::new(),
        };
        let assets =
            config.target.source.chat_assets(&template_kwargs).map_err(anyhow::Error::msg).with_context(what)?;
        let stream = Stream::open(&s.dir, &stream_root(config)).with_context(what)?;
        let base_len = base.len();
        let data = Arc::new(StreamData::new(base));
        let (vocab_size, positions) = (target.vocab_size, target.positions());
        let waves: Vec<std::ops::Range<usize>> = stream
            .waves()
            .iter()
            .map(|w| data.push(wave_data(&stream.wave_dir(w.number), vocab_size, positions)))
            .collect();
        crate::telemetry::stream_wave(waves.len() as u64, 0, 0, 0);
        tracing::info!(
            stream = %s.dir.display(),
            waves = waves.len(),
            base = base_len,
            "data.stream: learning from the conversations that arrive, each wave once with {:.0}% replay",
            100.0 * s.mix
        );
        let settings = WaveSettings {
            answers: s.answers,
            min_conversations: s.min_conversations,
            max_wait: s.max_wait,
            prepare: PrepareOptions {
                inputs: vec![],
                out: PathBuf::new(),
                max_len: config.data.max_len,
                long: LongConversations::Truncate,
                block_size: config.draft_model.block_size,
                holdout: config.data.holdout,
                seed: config.objective.seed,
                template_kwargs,
                strict: false,
                progress: false,
                force: true,
            },
        };
        Ok(Some(StreamRun {
            stream,
            data,
            epochs: StreamEpochs { waves, mix: s.mix },
            assets,
            settings,
            poll: s.poll,
            vocab_size,
            positions,
        }))
    }

    /// The run's data: the base data, then every wave's.
    pub fn dataset(&self) -> Arc<dyn Dataset> {
        self.data.clone()
    }

    /// The waves known at start, as the schedule's epochs.
    pub fn epochs(&self) -> StreamEpochs {
        self.epochs.clone()
    }

    /// Starts the thread that makes the next waves and hands each to `tell` (as [`Event::Wave`]).
    pub fn start(mut self, tell: impl Fn(Event) + Send + 'static) -> std::io::Result<Background> {
        Background::spawn("stream", move |stop| {
            let mut next_look = Instant::now();
            let mut told = None;
            while !stop.load(Ordering::SeqCst) {
                if Instant::now() < next_look {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                next_look = Instant::now() + self.poll;
                match self.next_wave() {
                    Ok(Some(event)) => tell(event),
                    Ok(None) => {}
                    Err(e) => tracing::warn!("data.stream: {e:#}; looking again in {:.0} s", self.poll.as_secs_f64()),
                }
                let pending = self.stream.pending();
                let due_in = pending.due_in(&self.settings);
                crate::telemetry::stream_pending(pending.conversations, due_in);
                let now = (pending.conversations, due_in.map(|d| Instant::now() + d));
                if pending_changed(told, now, self.poll) {
                    told = Some(now);
                    tell(Event::StreamPending { conversations: pending.conversations, due_in });
                }
            }
        })
    }

    /// The next wave, made and added to the run's data, as the supervisor hears of it.
    fn next_wave(&mut self) -> Result<Option<Event>> {
        let Some(wave) = self.stream.next_wave(&self.assets, &self.settings)? else { return Ok(None) };
        let split = wave_data(&self.stream.wave_dir(wave.number), self.vocab_size, self.positions);
        let Wave { number, conversations, sampled, unreadable, .. } = wave;
        tracing::info!(
            wave = number,
            conversations,
            trained = split.len(),
            sampled,
            unreadable,
            "data.stream: wave {number} made ({sampled} sampled answers and {unreadable} unreadable lines left out)"
        );
        crate::telemetry::stream_wave(number, conversations, sampled, unreadable);
        let (lengths, ids) = (split.lengths(), (0..split.len()).map(|p| split.id(p).clone()).collect());
        self.data.push(split);
        Ok(Some(Event::Wave { number, lengths, ids }))
    }
}

/// Whether a look's pending conversations, `(count, when they make a wave)`, are news against what was told last:
/// another count, or a due time moved by more than `slack` (a look's clock, not the files, moves it that much).
fn pending_changed(told: Option<(usize, Option<Instant>)>, now: (usize, Option<Instant>), slack: Duration) -> bool {
    let Some((count, due)) = told else { return true };
    count != now.0
        || match (due, now.1) {
            (Some(before), Some(after)) => before.max(after) - before.min(after) > slack,
            (before, after) => before.is_some() != after.is_some(),
        }
}

/// A logged wave's train split, checked against the target; one that cannot be read or does not fit is logged as an
/// error and trains nothing (an empty epoch), so that the schedule's epochs stay the waves' numbers across restarts
/// and one bad wave never keeps the run from starting.
fn wave_data(dir: &Path, vocab_size: usize, positions: usize) -> Arc<dyn Dataset> {
    let opened = PreparedSplit::open(dir, "train", false).map_err(anyhow::Error::from).and_then(|split| {
        split.check_fits(dir, vocab_size, positions).context("does not fit the target")?;
        Ok(split)
    });
    match opened {
        Ok(split) => Arc::new(split),
        Err(e) => {
            tracing::error!(wave = %dir.display(), "data.stream: this wave trains nothing: {e:#}");
            Arc::new(NoSamples)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_conversations_are_told_when_they_change_not_as_the_clock_moves() {
        let (t, second) = (Instant::now(), Duration::from_secs(1));
        let slack = 10 * second;
        assert!(pending_changed(None, (0, None), slack), "the first look is told");
        assert!(!pending_changed(Some((0, None)), (0, None), slack));
        assert!(pending_changed(Some((0, None)), (2, Some(t)), slack), "conversations arrived");
        assert!(!pending_changed(Some((2, Some(t))), (2, Some(t + second)), slack), "the clock's jitter");
        assert!(pending_changed(Some((2, Some(t))), (2, Some(t + 60 * second)), slack), "an older file left");
        assert!(pending_changed(Some((2, Some(t))), (2, None), slack), "the bound was lifted");
    }
}
