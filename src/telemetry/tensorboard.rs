//! TensorBoard event files (`log.tensorboard`): the run's scalars in `checkpoint.dir/tensorboard/`, so that
//! `tensorboard --logdir runs/NAME` shows it the way the field's trainers (HF Trainer's `report_to="tensorboard"`,
//! speculators, SpecForge) are watched, with no service running. Each progress line (`log.every_steps`) adds the
//! training scalars, each evaluation its own.
//!
//! The format is small enough to write directly rather than through a protobuf stack: TFRecord framing (length,
//! masked CRC-32C of the length, the record, masked CRC-32C of the record) around `tensorflow.Event` messages, the
//! first carrying `file_version`, each later one a `Summary` of `simple_value` scalars. `tests/fixtures/tensorboard`
//! holds the same events written by TensorBoard's own Python package (scripts/fixtures/make_tensorboard_fixture.py); the
//! tests compare the bytes.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The folder of the event files inside a run's `checkpoint.dir`.
pub const DIR: &str = "tensorboard";

/// Appends events to one event file.
pub struct EventFile {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventFile {
    /// A new event file in `dir` (created), named as TensorBoard's writers name theirs, its first event written at
    /// `wall_time` (seconds since the Unix epoch).
    pub fn create(dir: &Path, wall_time: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = hostname();
        let path = dir.join(format!("events.out.tfevents.{}.{host}.{}.dflash", wall_time as u64, std::process::id()));
        let file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?;
        let mut this = EventFile { out: BufWriter::new(file), path };
        this.write_record(&file_version_event(wall_time))?;
        Ok(this)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event of `scalars` (tag, value) at `step`, flushed: a reader sees it at once, a crash loses none written.
    pub fn scalars(&mut self, wall_time: f64, step: u64, scalars: &[(&str, f64)]) -> std::io::Result<()> {
        self.write_record(&scalar_event(wall_time, step, scalars))
    }

    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.out.write_all(&frame(data))?;
        self.out.flush()
    }
}

/// The host name as a file name can carry it.
fn hostname() -> String {
    let name: String =
        super::host_name().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.').collect();
    if name.is_empty() { "localhost".into() } else { name }
}

/// A TFRecord: the length, its masked CRC, the data, the data's masked CRC.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

// Protobuf wire format: a field's key is (number << 3) | wire type; 1: 64-bit, 2: length-delimited, 5: 32-bit.

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(number: u64, data: &[u8], out: &mut Vec<u8>) {
    varint(number << 3 | 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// `Event { wall_time: 1, file_version: 3 }`.
fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut e = vec![1 << 3 | 1];
    e.extend_from_slice(&wall_time.to_le_bytes());
    bytes_field(3, b"brain.Event:2", &mut e);
    e
}

/// `Event { wall_time: 1, step: 2, summary: 5 }`, `Summary { repeated Value value: 1 }`,
/// `Value { tag: 1, simple_value: 2 (float) }`.
fn scalar_event(wall_time: f64, step: u64, scalars: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, value) in scalars {
        let mut v = Vec::new();
        bytes_field(1, tag.as_bytes(), &mut v);
        v.push(2 << 3 | 5);
        v.extend_from_slice(&(*value as f32).to_le_bytes());
        bytes_field(1, &v, &mut summary);
    }
    let mut e = vec![1 << 3 | 1];
    e.extend_from_slice(&wall_time.to_le_bytes());
    if step > 0 {
        varint(2 << 3, &mut e);
        varint(step, &mut e);
    }
    bytes_field(5, &summary, &mut e);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events scripts/fixtures/make_tensorboard_fixture.py wrote with TensorBoard's own writer: the same bytes.
    #[test]
    fn writes_what_tensorboards_own_writer_writes() {
        let fixture = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tensorboard/events.bin"))
            .expect("the fixture");
        let mut ours = frame(&file_version_event(1_700_000_000.25));
        ours.extend(frame(&scalar_event(
            1_700_000_001.5,
            10,
            &[("train/loss", 2.5), ("train/lr", 0.001), ("train/acceptance_length", 1.75)],
        )));
        ours.extend(frame(&scalar_event(1_700_000_002.0, 0, &[("eval/decoded_acceptance_length", 3.125)])));
        ours.extend(frame(&scalar_event(1_700_000_003.0, 1_234_567, &[("train/loss", -0.0625)])));
        assert_eq!(ours, fixture);
    }

    #[test]
    fn an_event_file_is_named_and_framed_as_tensorboard_expects() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = EventFile::create(dir.path(), 1_700_000_000.0).unwrap();
        f.scalars(1_700_000_001.0, 3, &[("train/loss", 1.0)]).unwrap();
        let name = f.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents.1700000000.") && name.ends_with(".dflash"), "{name}");
        let bytes = std::fs::read(f.path()).unwrap();
        let first = frame(&file_version_event(1_700_000_000.0));
        assert_eq!(&bytes[..first.len()], &first[..]);
        assert_eq!(&bytes[first.len()..], &frame(&scalar_event(1_700_000_001.0, 3, &[("train/loss", 1.0)]))[..]);
        // The same name again (the same second and process) is refused, never written over.
        assert!(EventFile::create(dir.path(), 1_700_000_000.0).is_err());
    }
}
