//! A fault-injecting TCP proxy that understands Kafka's wire framing, for fault tests.
//!
//! Every Kafka request and response is a frame: a 4-byte big-endian size, then the body. A
//! request body starts with `api_key: i16, api_version: i16, correlation_id: i32`; a response
//! body starts with the `correlation_id: i32` of the request it answers. The proxy forwards
//! frames both ways unchanged, remembers per connection which API each correlation id asked,
//! and can, per API key:
//!
//! - **delay** a response (the connection's later responses wait behind it, as on a slow
//!   link),
//! - **drop** a response: the request has reached the broker (and may have taken effect), the
//!   answer never reaches the client, and the connection is closed, so the client sees an
//!   outcome it cannot know,
//! - **cut** every connection for a while: open ones are closed and new ones are accepted and
//!   closed at once until the time is up.
//!
//! Clients stay behind the proxy because the broker advertises the proxy's port (see
//! [`ProxiedBroker`]): every Metadata and FindCoordinator answer names the proxy, so every
//! connection a client opens goes through it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Kafka API keys the fault tests name.
pub mod api {
    pub const PRODUCE: i16 = 0;
    pub const FETCH: i16 = 1;
    pub const LIST_OFFSETS: i16 = 2;
    pub const METADATA: i16 = 3;
    pub const OFFSET_COMMIT: i16 = 8;
    pub const OFFSET_FETCH: i16 = 9;
    pub const FIND_COORDINATOR: i16 = 10;
    pub const JOIN_GROUP: i16 = 11;
    pub const HEARTBEAT: i16 = 12;
    pub const INIT_PRODUCER_ID: i16 = 22;
    pub const ADD_PARTITIONS_TO_TXN: i16 = 24;
    pub const ADD_OFFSETS_TO_TXN: i16 = 25;
    pub const END_TXN: i16 = 26;
    pub const TXN_OFFSET_COMMIT: i16 = 28;
}

/// What to do with a matching response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Hold the response this long before forwarding it.
    Delay(Duration),
    /// Never forward the response; close the client's connection instead.
    Drop,
}

#[derive(Debug)]
struct Rule {
    api_key: i16,
    /// Applies to the request (held before it reaches the broker) instead of the response.
    request: bool,
    action: Action,
    /// How many matching responses pass untouched before it applies.
    skip: u32,
    /// How many more responses it applies to; `None`: all, until cleared.
    remaining: Option<u32>,
}

#[derive(Default)]
struct Counters {
    requests: HashMap<i16, u64>,
    dropped: HashMap<i16, u64>,
    delayed: HashMap<i16, u64>,
}

struct Shared {
    upstream: SocketAddr,
    rules: Mutex<Vec<Rule>>,
    counters: Mutex<Counters>,
    /// Both sockets of every live connection, to close them on a cut.
    conns: Mutex<Vec<(TcpStream, TcpStream)>>,
    cut_until: Mutex<Option<Instant>>,
    stop: AtomicBool,
    accepted: AtomicU64,
}

impl Shared {
    /// The action for the next response of `api_key`, consuming one use of its rule.
    fn take_action(&self, api_key: i16, request: bool) -> Option<Action> {
        let mut rules = self.rules.lock().unwrap();
        let i = rules
            .iter()
            .position(|r| r.api_key == api_key && r.request == request)?;
        if rules[i].skip > 0 {
            rules[i].skip -= 1;
            return None;
        }
        let action = rules[i].action;
        if let Some(n) = rules[i].remaining.as_mut() {
            *n -= 1;
            if *n == 0 {
                rules.remove(i);
            }
        }
        Some(action)
    }

    fn count(map: &mut HashMap<i16, u64>, api_key: i16) {
        *map.entry(api_key).or_default() += 1;
    }

    fn cut_active(&self) -> bool {
        let mut until = self.cut_until.lock().unwrap();
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    fn close_all(&self) {
        for (c, u) in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
            let _ = u.shutdown(Shutdown::Both);
        }
    }
}

/// The proxy; it stops (closing every connection) when dropped.
pub struct KafkaProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl KafkaProxy {
    /// Listen on `127.0.0.1:<port>` (0: any free port) and forward to `upstream`. The
    /// upstream need not be up yet: a connection is refused until it is.
    pub fn start(port: u16, upstream: SocketAddr) -> io::Result<KafkaProxy> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            rules: Mutex::new(Vec::new()),
            counters: Mutex::new(Counters::default()),
            conns: Mutex::new(Vec::new()),
            cut_until: Mutex::new(None),
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kafka-proxy-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(KafkaProxy {
            shared,
            addr,
            accept: Some(accept),
        })
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Drop the next `n` responses of `api_key` (each closes its connection).
    pub fn drop_next(&self, api_key: i16, n: u32) {
        self.add(api_key, Action::Drop, 0, Some(n));
    }

    /// Let `skip` responses of `api_key` pass, then drop the next one.
    pub fn drop_after(&self, api_key: i16, skip: u32) {
        self.add(api_key, Action::Drop, skip, Some(1));
    }

    /// Delay the next `n` responses of `api_key` by `by`.
    pub fn delay_next(&self, api_key: i16, n: u32, by: Duration) {
        self.add(api_key, Action::Delay(by), 0, Some(n));
    }

    /// Let `skip` responses of `api_key` pass, then delay the next one by `by`.
    pub fn delay_after(&self, api_key: i16, skip: u32, by: Duration) {
        self.add(api_key, Action::Delay(by), skip, Some(1));
    }

    /// Let `skip` requests of `api_key` pass, then hold the next one for `by` before it
    /// reaches the broker.
    pub fn delay_request_after(&self, api_key: i16, skip: u32, by: Duration) {
        self.push(Rule {
            api_key,
            request: true,
            action: Action::Delay(by),
            skip,
            remaining: Some(1),
        });
    }

    /// Delay every response of `api_key` by `by` until [`KafkaProxy::clear`].
    pub fn delay_all(&self, api_key: i16, by: Duration) {
        self.add(api_key, Action::Delay(by), 0, None);
    }

    /// Forget every rule not used up yet.
    pub fn clear(&self) {
        self.shared.rules.lock().unwrap().clear();
    }

    /// Whether every `drop_next` / `delay_next` rule has been used up.
    pub fn rules_used_up(&self) -> bool {
        self.shared
            .rules
            .lock()
            .unwrap()
            .iter()
            .all(|r| r.remaining.is_none())
    }

    /// Close every open connection and refuse new ones for `d`.
    pub fn cut_for(&self, d: Duration) {
        *self.shared.cut_until.lock().unwrap() = Some(Instant::now() + d);
        self.shared.close_all();
    }

    /// Requests of `api_key` seen so far.
    pub fn requests(&self, api_key: i16) -> u64 {
        let c = self.shared.counters.lock().unwrap();
        c.requests.get(&api_key).copied().unwrap_or(0)
    }

    /// Responses of `api_key` dropped so far.
    pub fn dropped(&self, api_key: i16) -> u64 {
        let c = self.shared.counters.lock().unwrap();
        c.dropped.get(&api_key).copied().unwrap_or(0)
    }

    /// Responses of `api_key` delayed so far.
    pub fn delayed(&self, api_key: i16) -> u64 {
        let c = self.shared.counters.lock().unwrap();
        c.delayed.get(&api_key).copied().unwrap_or(0)
    }

    /// Client connections accepted so far (cut ones included).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    fn add(&self, api_key: i16, action: Action, skip: u32, remaining: Option<u32>) {
        if remaining == Some(0) {
            return;
        }
        self.push(Rule {
            api_key,
            request: false,
            action,
            skip,
            remaining,
        });
    }

    fn push(&self, rule: Rule) {
        self.shared.rules.lock().unwrap().push(rule);
    }
}

impl Drop for KafkaProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        self.shared.close_all();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                if shared.cut_active() {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let _ = client.set_nonblocking(false);
                let upstream =
                    match TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(2)) {
                        Ok(u) => u,
                        Err(_) => {
                            let _ = client.shutdown(Shutdown::Both);
                            continue;
                        }
                    };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                if let Err(e) = spawn_connection(&shared, client, upstream) {
                    eprintln!("kafka proxy: cannot serve a connection: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                eprintln!("kafka proxy: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn spawn_connection(
    shared: &Arc<Shared>,
    client: TcpStream,
    upstream: TcpStream,
) -> io::Result<()> {
    shared
        .conns
        .lock()
        .unwrap()
        .push((client.try_clone()?, upstream.try_clone()?));
    // correlation id -> api key of the requests still waiting for their response
    let inflight: Arc<Mutex<HashMap<i32, i16>>> = Arc::default();

    let (mut c_in, mut u_out) = (client.try_clone()?, upstream.try_clone()?);
    let (s, pending) = (shared.clone(), inflight.clone());
    std::thread::Builder::new()
        .name("kafka-proxy-req".into())
        .spawn(move || {
            while let Ok(frame) = read_frame(&mut c_in) {
                if frame.len() >= 8 {
                    let api_key = i16::from_be_bytes([frame[0], frame[1]]);
                    let corr = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
                    pending.lock().unwrap().insert(corr, api_key);
                    Shared::count(&mut s.counters.lock().unwrap().requests, api_key);
                    if let Some(Action::Delay(d)) = s.take_action(api_key, true) {
                        Shared::count(&mut s.counters.lock().unwrap().delayed, api_key);
                        std::thread::sleep(d);
                    }
                }
                if write_frame(&mut u_out, &frame).is_err() {
                    break;
                }
            }
            let _ = c_in.shutdown(Shutdown::Both);
            let _ = u_out.shutdown(Shutdown::Both);
        })?;

    let (mut u_in, mut c_out) = (upstream, client);
    let s = shared.clone();
    std::thread::Builder::new()
        .name("kafka-proxy-resp".into())
        .spawn(move || {
            while let Ok(frame) = read_frame(&mut u_in) {
                let api_key = (frame.len() >= 4)
                    .then(|| i32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]))
                    .and_then(|corr| inflight.lock().unwrap().remove(&corr));
                match api_key.and_then(|k| s.take_action(k, false).map(|a| (k, a))) {
                    Some((k, Action::Drop)) => {
                        Shared::count(&mut s.counters.lock().unwrap().dropped, k);
                        break;
                    }
                    Some((k, Action::Delay(d))) => {
                        Shared::count(&mut s.counters.lock().unwrap().delayed, k);
                        std::thread::sleep(d);
                    }
                    None => {}
                }
                if write_frame(&mut c_out, &frame).is_err() {
                    break;
                }
            }
            let _ = u_in.shutdown(Shutdown::Both);
            let _ = c_out.shutdown(Shutdown::Both);
        })?;
    Ok(())
}

/// Kafka frames are at most this big here (the broker's default `socket.request.max.bytes`
/// is 100 MiB); a larger size means the stream is not Kafka's framing.
const MAX_FRAME: usize = 128 << 20;

fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut size = [0u8; 4];
    r.read_exact(&mut size)?;
    let n = i32::from_be_bytes(size);
    if n < 0 || n as usize > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame size {n} is not Kafka framing"),
        ));
    }
    let mut body = vec![0u8; n as usize];
    r.read_exact(&mut body)?;
    Ok(body)
}

fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    w.write_all(&(body.len() as i32).to_be_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// A dedicated single-node broker (scripts/kafka on its own ports and a fresh data dir) whose
/// client listener is advertised as a [`KafkaProxy`]'s port, so every client stays behind the
/// proxy. Inter-broker traffic (transaction markers) uses a listener of its own, outside the
/// proxy. Stopped and deleted when dropped.
pub struct ProxiedBroker {
    pub proxy: KafkaProxy,
    /// The port the broker itself listens on for clients (behind the proxy).
    pub broker_port: u16,
    controller_port: u16,
    internal_port: u16,
    data: tempfile::TempDir,
}

impl ProxiedBroker {
    /// Start the proxy on a free port, then the broker on `base_port` (client listener),
    /// `base_port + 1` (controller) and `base_port + 2` (inter-broker).
    ///
    /// # Panics
    /// When the broker does not start (a test set-up failure).
    pub fn start(base_port: u16) -> ProxiedBroker {
        let upstream: SocketAddr = format!("127.0.0.1:{base_port}").parse().unwrap();
        let proxy = KafkaProxy::start(0, upstream).expect("start the kafka proxy");
        let b = ProxiedBroker {
            proxy,
            broker_port: base_port,
            controller_port: base_port + 1,
            internal_port: base_port + 2,
            data: tempfile::tempdir().unwrap(),
        };
        b.kafka(&["start"]);
        b
    }

    /// The address clients bootstrap from: the proxy.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.proxy.port())
    }

    /// The broker's process id (from `scripts/kafka`'s pid file).
    pub fn pid(&self) -> i32 {
        let pid = std::fs::read_to_string(self.data.path().join("kafka.pid"))
            .expect("the broker's pid file");
        pid.trim().parse().expect("a pid")
    }

    /// Send `signal` to the broker (SIGSTOP freezes it: its listener still accepts
    /// connections, nothing answers; SIGCONT resumes it).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the broker this test started.
        let r = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(r, 0, "signal {signal} to the broker");
    }

    /// SIGKILL the broker (no controlled shutdown); [`ProxiedBroker::kafka`]`(&["start"])`
    /// starts it again on the same data.
    pub fn kill(&self) {
        let pid = self.pid();
        // SAFETY: kill(2) on the broker this test started.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        // SAFETY: signal 0 only checks that the process exists.
        while unsafe { libc::kill(pid, 0) } == 0 {
            assert!(
                Instant::now() < deadline,
                "broker pid {pid} survived SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Run `scripts/kafka ARGS` against this broker; panics when it fails. A start that
    /// fails because a port is taken is tried again (up to 10 times, 2 s apart): the
    /// broker's ports lie in the kernel's ephemeral range, so a client connection elsewhere
    /// on the machine may hold one for a moment.
    pub fn kafka(&self, args: &[&str]) -> String {
        for _ in 0..10 {
            match self.kafka_once(args) {
                Ok(out) => return out,
                Err(e) if e.contains("Address already in use") => {
                    eprintln!("scripts/kafka {args:?}: a port is taken; trying again in 2 s");
                    std::thread::sleep(Duration::from_secs(2));
                }
                Err(e) => panic!("scripts/kafka {args:?} failed:\n{e}"),
            }
        }
        panic!("scripts/kafka {args:?} failed: a port stayed taken for 20 s")
    }

    fn kafka_once(&self, args: &[&str]) -> Result<String, String> {
        let script: PathBuf = [env!("CARGO_MANIFEST_DIR"), "scripts", "kafka"]
            .iter()
            .collect();
        let out = std::process::Command::new(script)
            .args(args)
            .env("ONCEFLOW_BROKER_PORT", self.broker_port.to_string())
            .env(
                "ONCEFLOW_BROKER_CONTROLLER_PORT",
                self.controller_port.to_string(),
            )
            .env(
                "ONCEFLOW_BROKER_INTERNAL_PORT",
                self.internal_port.to_string(),
            )
            .env(
                "ONCEFLOW_BROKER_ADVERTISED_PORT",
                self.proxy.port().to_string(),
            )
            .env("ONCEFLOW_BROKER_DATA", self.data.path())
            .env("ONCEFLOW_BROKER_HEAP_OPTS", "-Xmx512m -Xms256m")
            // A start after a SIGKILL recovers every partition's log first (the internal
            // topics alone are 100 partitions); beside the other tests' brokers on a
            // 2-core machine it once took over scripts/kafka's default 120 s (CI, 12-07).
            .env("ONCEFLOW_BROKER_START_TIMEOUT", "300")
            .output()
            .expect("run scripts/kafka");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl Drop for ProxiedBroker {
    fn drop(&mut self) {
        let script: PathBuf = [env!("CARGO_MANIFEST_DIR"), "scripts", "kafka"]
            .iter()
            .collect();
        let _ = std::process::Command::new(script)
            .arg("stop")
            .env("ONCEFLOW_BROKER_PORT", self.broker_port.to_string())
            .env(
                "ONCEFLOW_BROKER_CONTROLLER_PORT",
                self.controller_port.to_string(),
            )
            .env("ONCEFLOW_BROKER_DATA", self.data.path())
            .output();
    }
}
