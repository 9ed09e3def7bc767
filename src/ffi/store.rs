//! `csrc/store.cpp`: a connection to c10d's TCPStore, a key-value store with blocking reads, served by one process
//! (the rendezvous host) and reached by every host over TCP. Values are bytes; every wait has a deadline, and a
//! passed deadline is its own error ([`StoreError::Timeout`]) so that a missing peer is a decision, not a hang.
//! A connection serialises its operations: give each thread its own ([`Store::try_clone`]).
use std::ffi::{CString, c_char, c_int, c_void};
use std::time::Duration;

use thiserror::Error;

use super::call;

unsafe extern "C" {
    fn dflash_store_open(
        host: *const c_char,
        port: c_int,
        is_server: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        bound_port: *mut c_int,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_clone(store: *mut c_void, out: *mut *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_store_set_timeout(store: *mut c_void, timeout_ms: i64, err: *mut c_char, len: usize) -> c_int;
    fn dflash_store_close(store: *mut c_void);
    fn dflash_store_free_bytes(data: *mut u8);
    fn dflash_store_set(
        store: *mut c_void,
        key: *const c_char,
        data: *const u8,
        size: usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_get(
        store: *mut c_void,
        key: *const c_char,
        timeout_ms: i64,
        out: *mut *mut u8,
        out_len: *mut usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_add(
        store: *mut c_void,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_compare_set(
        store: *mut c_void,
        key: *const c_char,
        expected: *const u8,
        expected_len: usize,
        desired: *const u8,
        desired_len: usize,
        out: *mut *mut u8,
        out_len: *mut usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_check(
        store: *mut c_void,
        key: *const c_char,
        out: *mut c_int,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_store_delete(store: *mut c_void, key: *const c_char, err: *mut c_char, len: usize) -> c_int;
}

/// How long past its deadline a connection may take before its peer is judged not a store ([`Store::connect`]).
pub const NOT_A_STORE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("the store at {address}: {what} {key:?} timed out after {waited:.1} s (limit {limit:.1} s)")]
    Timeout { address: String, what: &'static str, key: String, waited: f64, limit: f64 },
    #[error("the store at {address}: {what} {key:?}: {message}")]
    Failed { address: String, what: &'static str, key: String, message: String },
    #[error(
        "{address} accepts connections but did not answer as a c10d store within {waited:.1} s: is it the rendezvous \
         host's store (cluster.master_addr and cluster.master_port)?"
    )]
    NotAStore { address: String, waited: f64 },
    #[error("store key {0:?} holds a NUL byte")]
    BadKey(String),
}

/// One connection to a TCPStore (the server's own, for the process that serves it).
pub struct Store {
    raw: *mut c_void,
    address: String,
    /// The deadline of operations that take none of their own (connecting, setting, adding).
    timeout: Duration,
}

// SAFETY: a connection is used by one thread at a time (`&mut`-free methods, but `Store` is not `Sync`); libtorch's
// TCPStore client may move between threads.
unsafe impl Send for Store {}

impl Store {
    /// Serves a store on `port` (0: any free one, see [`Store::port`]), on IPv4 (every interface: see
    /// `csrc/store.cpp` for why not dual-stack), and connects to it.
    pub fn serve(port: u16, timeout: Duration) -> Result<Store, StoreError> {
        Self::open("127.0.0.1", port, true, timeout)
    }

    /// Connects to the store served at `host:port`, retrying until `timeout` (the server may start later). A peer
    /// that accepts the connection but never answers as a store (another service on that port) blocks libtorch's
    /// client without a deadline: the connection is made on a thread of its own, abandoned (left blocked, its store
    /// closed should it ever connect) when it has not finished [`NOT_A_STORE_GRACE`] past `timeout`.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Store, StoreError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let owned_host = host.to_string();
        std::thread::Builder::new()
            .name("store-connect".into())
            .spawn(move || {
                let result = Self::open(&owned_host, port, false, timeout);
                // Given up on: the connection is closed by dropping it.
                let _ = tx.send(result);
            })
            .map_err(|e| StoreError::Failed {
                address: format!("{host}:{port}"),
                what: "connecting to",
                key: String::new(),
                message: format!("starting a thread: {e}"),
            })?;
        let waited = timeout + NOT_A_STORE_GRACE;
        match rx.recv_timeout(waited) {
            Ok(result) => result,
            Err(_) => Err(StoreError::NotAStore { address: format!("{host}:{port}"), waited: waited.as_secs_f64() }),
        }
    }

    fn open(host: &str, port: u16, is_server: bool, timeout: Duration) -> Result<Store, StoreError> {
        let address = format!("{host}:{port}");
        let c_host = CString::new(host).map_err(|_| StoreError::BadKey(host.into()))?;
        let (mut raw, mut bound) = (std::ptr::null_mut(), 0);
        let what = if is_server { "serving" } else { "connecting to" };
        shim(&address, what, "", timeout, |e, n| unsafe {
            // SAFETY: valid C string and out-pointers; the shim writes them on success.
            dflash_store_open(
                c_host.as_ptr(),
                port as c_int,
                is_server as c_int,
                millis(timeout),
                &mut raw,
                &mut bound,
                e,
                n,
            )
        })?;
        Ok(Store { raw, address: format!("{host}:{bound}"), timeout })
    }

    /// `host:port` of the store (the port actually bound when serving on port 0).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The port of the store.
    pub fn port(&self) -> u16 {
        self.address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
    }

    /// The deadline of later operations that give none of their own, and of connecting a clone (a connection is
    /// opened with the rendezvous's patience; once the run is under way a store that does not answer is gone).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), StoreError> {
        // SAFETY: live store.
        shim(&self.address, "setting the deadline of", "", self.timeout, |e, n| unsafe {
            dflash_store_set_timeout(self.raw, millis(timeout), e, n)
        })?;
        self.timeout = timeout;
        Ok(())
    }

    /// Another connection to the same store, for another thread.
    pub fn try_clone(&self) -> Result<Store, StoreError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live store; the shim writes `raw` on success.
        shim(&self.address, "cloning a connection to", "", self.timeout, |e, n| unsafe {
            dflash_store_clone(self.raw, &mut raw, e, n)
        })?;
        Ok(Store { raw, address: self.address.clone(), timeout: self.timeout })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let k = c_key(key)?;
        // SAFETY: live store, valid key and buffer.
        shim(&self.address, "setting", key, self.timeout, |e, n| unsafe {
            dflash_store_set(self.raw, k.as_ptr(), value.as_ptr(), value.len(), e, n)
        })
    }

    /// Waits up to `timeout` for `key` to be set, then reads it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let k = c_key(key)?;
        let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
        // SAFETY: live store, valid key; on success the shim hands over a malloc'd buffer of `size` bytes.
        shim(&self.address, "reading", key, timeout, |e, n| unsafe {
            dflash_store_get(self.raw, k.as_ptr(), millis(timeout), &mut data, &mut size, e, n)
        })?;
        Ok(take_bytes(data, size))
    }

    /// Adds `delta` to the counter at `key` (0 when absent) and returns the new value; `add(key, 0)` reads it.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let k = c_key(key)?;
        let mut out = 0;
        // SAFETY: live store, valid key and out-pointer.
        shim(&self.address, "adding to", key, self.timeout, |e, n| unsafe {
            dflash_store_add(self.raw, k.as_ptr(), delta, &mut out, e, n)
        })?;
        Ok(out)
    }

    /// Sets `key` to `desired` if it holds `expected` (an empty `expected`: if it is absent), atomically; returns
    /// what `key` holds afterwards (`desired` when this call set it).
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        let k = c_key(key)?;
        let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
        // SAFETY: live store, valid key and buffers; on success the shim hands over a malloc'd buffer.
        shim(&self.address, "compare-and-set of", key, self.timeout, |e, n| unsafe {
            dflash_store_compare_set(
                self.raw,
                k.as_ptr(),
                expected.as_ptr(),
                expected.len(),
                desired.as_ptr(),
                desired.len(),
                &mut data,
                &mut size,
                e,
                n,
            )
        })?;
        Ok(take_bytes(data, size))
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool, StoreError> {
        let k = c_key(key)?;
        let mut out = 0;
        // SAFETY: live store, valid key and out-pointer.
        shim(&self.address, "checking", key, self.timeout, |e, n| unsafe {
            dflash_store_check(self.raw, k.as_ptr(), &mut out, e, n)
        })?;
        Ok(out != 0)
    }

    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let k = c_key(key)?;
        // SAFETY: live store, valid key.
        shim(&self.address, "deleting", key, self.timeout, |e, n| unsafe {
            dflash_store_delete(self.raw, k.as_ptr(), e, n)
        })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim and is closed once.
        unsafe { dflash_store_close(self.raw) }
    }
}

fn c_key(key: &str) -> Result<CString, StoreError> {
    CString::new(key).map_err(|_| StoreError::BadKey(key.into()))
}

fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

/// Copies and frees a buffer the shim handed over.
fn take_bytes(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return vec![];
    }
    // SAFETY: the shim malloc'd `size` readable bytes at `data`; they are copied, then freed once.
    let out = unsafe { std::slice::from_raw_parts(data, size) }.to_vec();
    unsafe { dflash_store_free_bytes(data) };
    out
}

/// Runs a shim call and turns its status into a [`StoreError`].
fn shim(
    address: &str,
    what: &'static str,
    key: &str,
    timeout: Duration,
    f: impl FnOnce(*mut c_char, usize) -> c_int,
) -> Result<(), StoreError> {
    call(f).map_err(|failed| {
        let (address, key) = (address.to_string(), key.to_string());
        match failed.deadline_passed_after {
            Some(waited) => StoreError::Timeout { address, what, key, waited, limit: timeout.as_secs_f64() },
            None => StoreError::Failed { address, what, key, message: failed.message },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn two_connections_share_keys_counters_and_compare_and_set() {
        let server = Store::serve(0, 10 * SECOND).unwrap();
        assert_ne!(server.port(), 0, "port 0 binds a free port: {}", server.address());
        let client = Store::connect("127.0.0.1", server.port(), 10 * SECOND).unwrap();
        server.set("plan", b"step 3").unwrap();
        assert_eq!(client.get("plan", SECOND).unwrap(), b"step 3");
        assert_eq!(client.add("joined", 1).unwrap(), 1);
        assert_eq!(server.add("joined", 2).unwrap(), 3);
        assert_eq!(client.add("joined", 0).unwrap(), 3, "adding 0 reads");
        // The first compare-and-set on an absent key wins; a second with a stale expectation changes nothing.
        assert_eq!(client.compare_set("leader", b"", b"host-1").unwrap(), b"host-1");
        assert_eq!(server.compare_set("leader", b"", b"host-0").unwrap(), b"host-1");
        assert_eq!(server.compare_set("leader", b"host-1", b"host-0").unwrap(), b"host-0");
        assert!(client.check("plan").unwrap() && !client.check("absent").unwrap());
        client.delete("plan").unwrap();
        assert!(!server.check("plan").unwrap());
        let other = client.try_clone().unwrap();
        other.set("empty", b"").unwrap();
        assert_eq!(server.get("empty", SECOND).unwrap(), b"");
    }

    #[test]
    fn a_read_waits_for_a_later_write_and_times_out_when_none_comes() {
        let server = Store::serve(0, 10 * SECOND).unwrap();
        let port = server.port();
        let writer = std::thread::spawn(move || {
            let c = Store::connect("127.0.0.1", port, 10 * SECOND).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            c.set("late", b"here").unwrap();
        });
        assert_eq!(server.get("late", 10 * SECOND).unwrap(), b"here");
        writer.join().unwrap();
        let started = std::time::Instant::now();
        let err = server.get("never", Duration::from_millis(300)).unwrap_err();
        let elapsed = started.elapsed().as_secs_f64();
        let StoreError::Timeout { waited, limit, .. } = err else { panic!("{err}") };
        assert!(elapsed < 5.0, "the deadline bounds the wait");
        // The message says the time actually waited, beside the limit.
        assert!(waited <= elapsed && waited >= 0.25 && limit == 0.3, "waited {waited} of {limit} in {elapsed}");
        let err = StoreError::Timeout { address: "a".into(), what: "reading", key: "never".into(), waited, limit };
        assert!(err.to_string().contains("\"never\""), "{err}");
        // The connection answers correctly after a read that timed out (hosts keep their connections across them),
        // even when the key it waited for comes later.
        server.set("never", b"now").unwrap();
        server.set("after", b"fine").unwrap();
        assert_eq!(server.get("after", SECOND).unwrap(), b"fine");
        assert_eq!(server.add("counter", 2).unwrap(), 2);
    }

    #[test]
    fn connecting_to_no_server_fails_within_the_deadline() {
        // A port just released: nobody serves it.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let err = Store::connect("127.0.0.1", port, Duration::from_millis(500)).err().expect("nobody serves it");
        assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
    }

    /// A port where something listens that is not a store (accepts, never answers): the connection fails within its
    /// deadline, named as such, rather than waiting forever.
    #[test]
    fn a_peer_that_is_not_a_store_is_named_within_the_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _silent = std::thread::spawn(move || {
            let held: Vec<_> = listener.incoming().take(64).collect();
            std::thread::sleep(Duration::from_secs(3600));
            drop(held);
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let result = Store::connect("127.0.0.1", port, Duration::from_secs(2)).err().map(|e| e.to_string());
            let _ = tx.send((result, started.elapsed()));
        });
        let (err, took) = rx.recv_timeout(Duration::from_secs(30)).expect("connecting still waits after 30 s");
        let err = err.expect("a silent peer is no store");
        assert!(took < Duration::from_secs(8), "failed after {took:?}, the deadline is 2 s");
        assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("did not answer as a c10d store"), "{err}");
    }
}
