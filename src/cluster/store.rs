//! The key-value store the hosts of a run meet in, as one interface (c10d's store operations: set, a blocking get,
//! add, compare-and-set, check, delete): the TCPStore connection every host holds ([`Store`]), and an in-memory one
//! ([`MemoryStore`]) with the same semantics, so the coordinator and its callers can be driven by a test or a
//! simulation with no server, no sockets and a clock of its own.
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::ffi::store::{Store, StoreError};

/// What the run's protocol needs of a store.
pub trait KeyValueStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Waits up to `timeout` for `key` to be set, then reads it ([`StoreError::Timeout`] past it).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError>;
    /// Adds `delta` to the counter at `key` (0 when absent) and returns the new value; `add(key, 0)` reads it.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Sets `key` to `desired` if it holds `expected` (an empty `expected`: if it is absent), atomically; returns
    /// what `key` holds afterwards.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError>;
    /// Whether `key` is set, without waiting.
    fn check(&self, key: &str) -> Result<bool, StoreError>;
    fn delete(&self, key: &str) -> Result<(), StoreError>;
}

impl KeyValueStore for Store {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        Store::set(self, key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        Store::get(self, key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        Store::add(self, key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        Store::compare_set(self, key, expected, desired)
    }
    fn check(&self, key: &str) -> Result<bool, StoreError> {
        Store::check(self, key)
    }
    fn delete(&self, key: &str) -> Result<(), StoreError> {
        Store::delete(self, key)
    }
}

/// A connection to the run's store that opens more of its kind: a host's link gives each operation a connection of its
/// own (a TCPStore connection must not be shared by threads) and its coordinator's thread one more. A shared
/// [`MemoryStore`] is its own connection (tests drive a host's link over one without TCP).
pub trait Connection: KeyValueStore + Send + Sized + 'static {
    fn another(&self) -> Result<Self, StoreError>;
}

impl Connection for Store {
    fn another(&self) -> Result<Self, StoreError> {
        self.try_clone()
    }
}

impl Connection for std::sync::Arc<MemoryStore> {
    fn another(&self) -> Result<Self, StoreError> {
        Ok(self.clone())
    }
}

/// A borrowed or shared store is a store (a coordinator over a test's or a simulation's [`MemoryStore`] that it
/// keeps reading).
macro_rules! store_through {
    ($($pointer:ty),*) => {$(
        impl<T: KeyValueStore + ?Sized> KeyValueStore for $pointer {
            fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
                (**self).set(key, value)
            }
            fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
                (**self).get(key, timeout)
            }
            fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
                (**self).add(key, delta)
            }
            fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
                (**self).compare_set(key, expected, desired)
            }
            fn check(&self, key: &str) -> Result<bool, StoreError> {
                (**self).check(key)
            }
            fn delete(&self, key: &str) -> Result<(), StoreError> {
                (**self).delete(key)
            }
        }
    )*};
}
store_through!(&T, std::rc::Rc<T>, std::sync::Arc<T>);

/// A store in this process's memory, shared by reference: a TCPStore's semantics (counters are decimal text, as
/// c10d keeps them; a get waits for the key) without its server.
#[derive(Default)]
pub struct MemoryStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn values(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the map leaves it whole (every change is one insert or remove).
        self.values.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn failed(what: &'static str, key: &str, message: String) -> StoreError {
        StoreError::Failed { address: "memory".into(), what, key: key.into(), message }
    }
}

impl KeyValueStore for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.values().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let started = Instant::now();
        let mut values = self.values();
        loop {
            if let Some(value) = values.get(key) {
                return Ok(value.clone());
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(StoreError::Timeout {
                    address: "memory".into(),
                    what: "reading",
                    key: key.into(),
                    waited: started.elapsed().as_secs_f64(),
                    limit: timeout.as_secs_f64(),
                });
            }
            values = self.changed.wait_timeout(values, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut values = self.values();
        let now = match values.get(key) {
            None => 0,
            Some(bytes) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
                .ok_or_else(|| Self::failed("adding to", key, "the key holds no counter".into()))?,
        } + delta;
        values.insert(key.to_string(), now.to_string().into_bytes());
        drop(values);
        self.changed.notify_all();
        Ok(now)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        let mut values = self.values();
        let swap = match values.get(key) {
            None => expected.is_empty(),
            Some(held) => held == expected,
        };
        if swap {
            values.insert(key.to_string(), desired.to_vec());
            drop(values);
            self.changed.notify_all();
            return Ok(desired.to_vec());
        }
        // Absent and `expected` given: c10d answers with `expected` itself.
        Ok(values.get(key).cloned().unwrap_or_else(|| expected.to_vec()))
    }

    fn check(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.values().contains_key(key))
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.values().remove(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-memory store answers every operation as the TCPStore does (the same script against both).
    #[test]
    fn the_memory_store_answers_as_the_tcp_store_does() {
        let server = Store::serve(0, Duration::from_secs(10)).unwrap();
        let memory = MemoryStore::new();
        let stores: [&dyn KeyValueStore; 2] = [&server, &memory];
        let answers: Vec<Vec<String>> = stores
            .iter()
            .map(|s| {
                let mut said = Vec::new();
                said.push(format!("{:?}", s.check("a")));
                s.set("a", b"one").unwrap();
                said.push(format!("{:?} {:?}", s.check("a"), s.get("a", Duration::from_secs(1))));
                said.push(format!("{:?} {:?}", s.add("n", 3), s.add("n", 0)));
                said.push(format!("{:?}", s.compare_set("a", b"two", b"three")));
                said.push(format!("{:?}", s.compare_set("a", b"one", b"three")));
                said.push(format!("{:?}", s.compare_set("fresh", b"", b"x")));
                said.push(format!("{:?}", s.compare_set("absent", b"want", b"y")));
                s.delete("a").unwrap();
                said.push(format!("{:?}", s.check("a")));
                let late = s.get("never", Duration::from_millis(50));
                said.push(format!("timeout: {}", matches!(late, Err(StoreError::Timeout { .. }))));
                said
            })
            .collect();
        assert_eq!(answers[0], answers[1]);
    }

    /// A get waits for a set from another thread.
    #[test]
    fn a_get_waits_for_the_set() {
        let store = std::sync::Arc::new(MemoryStore::new());
        let setter = store.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            setter.set("k", b"v").unwrap();
        });
        assert_eq!(store.get("k", Duration::from_secs(10)).unwrap(), b"v");
        t.join().unwrap();
    }
}
