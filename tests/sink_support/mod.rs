//! Test support for external sinks: a local HTTP receiver that logs every call with its
//! `Idempotency-Key`, and the PostgreSQL / Redis addresses from the environment.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One call the receiver answered.
#[derive(Debug, Clone)]
pub struct Call {
    /// The `Idempotency-Key` header, raw bytes (None if absent).
    pub key: Option<Vec<u8>>,
    /// Status answered.
    pub status: u16,
    /// Request body.
    pub body: Vec<u8>,
    /// Method.
    pub method: String,
}

/// Decides the answer to a call: (status, delay before answering), given the key and how
/// many calls with that key came before this one.
pub type Behaviour = Arc<dyn Fn(Option<&[u8]>, usize) -> (u16, Duration) + Send + Sync>;

/// A local HTTP/1.1 receiver (keep-alive, one thread per connection).
pub struct Receiver {
    pub url: String,
    pub calls: Arc<Mutex<Vec<Call>>>,
}

impl Receiver {
    /// Always 200 at once.
    pub fn ok() -> Receiver {
        Self::start(Arc::new(|_, _| (200, Duration::ZERO)))
    }

    /// Answer by `behaviour`.
    pub fn start(behaviour: Behaviour) -> Receiver {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", l.local_addr().unwrap());
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let seen: Arc<Mutex<HashMap<Option<Vec<u8>>, usize>>> = Arc::default();
        let c = calls.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let (c, b, seen) = (c.clone(), behaviour.clone(), seen.clone());
                std::thread::spawn(move || serve(s, c, b, seen));
            }
        });
        Receiver { url, calls }
    }

    /// Calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Calls per key.
    pub fn per_key(&self) -> HashMap<Vec<u8>, Vec<u16>> {
        let mut m: HashMap<Vec<u8>, Vec<u16>> = HashMap::new();
        for c in self.calls() {
            m.entry(c.key.unwrap_or_default())
                .or_default()
                .push(c.status);
        }
        m
    }
}

fn serve(
    s: TcpStream,
    calls: Arc<Mutex<Vec<Call>>>,
    b: Behaviour,
    seen: Arc<Mutex<HashMap<Option<Vec<u8>>, usize>>>,
) {
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    loop {
        let mut line = Vec::new();
        if r.read_until(b'\n', &mut line).unwrap_or(0) == 0 {
            return;
        }
        let method = String::from_utf8_lossy(&line)
            .split(' ')
            .next()
            .unwrap_or("")
            .to_string();
        let (mut len, mut key) = (0usize, None);
        loop {
            let mut h = Vec::new();
            if r.read_until(b'\n', &mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == b"\r\n" || h == b"\n" {
                break;
            }
            let Some(colon) = h.iter().position(|&c| c == b':') else {
                continue;
            };
            let name = String::from_utf8_lossy(&h[..colon]).to_ascii_lowercase();
            let mut v = &h[colon + 1..];
            while v.first() == Some(&b' ') {
                v = &v[1..];
            }
            while matches!(v.last(), Some(b'\r' | b'\n')) {
                v = &v[..v.len() - 1];
            }
            match name.as_str() {
                "content-length" => len = String::from_utf8_lossy(v).trim().parse().unwrap_or(0),
                "idempotency-key" => key = Some(v.to_vec()),
                _ => {}
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let n = {
            let mut m = seen.lock().unwrap();
            let e = m.entry(key.clone()).or_insert(0);
            *e += 1;
            *e - 1
        };
        let (status, delay) = b(key.as_deref(), n);
        std::thread::sleep(delay);
        calls.lock().unwrap().push(Call {
            key,
            status,
            body,
            method,
        });
        let text = format!("answer {status} #{n}");
        let resp = format!(
            "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nContent-Type: text/plain\r\n\r\n{text}",
            text.len()
        );
        if w.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// `ONCEFLOW_POSTGRES_URL`, or None after a loud message (the test then returns early).
/// Panics at once when it is set but nothing listens at its address.
pub fn postgres_url() -> Option<String> {
    env_or_skip("ONCEFLOW_POSTGRES_URL", "scripts/postgres start", 5432)
}

/// `ONCEFLOW_REDIS_URL`, or None after a loud message; panics at once when it is set but
/// nothing listens at its address.
pub fn redis_url() -> Option<String> {
    env_or_skip("ONCEFLOW_REDIS_URL", "scripts/redis start", 6379)
}

fn env_or_skip(var: &str, how: &str, default_port: u16) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => {
            assert_listening(var, &v, how, default_port);
            Some(v)
        }
        _ => {
            eprintln!(
                "\n*** SKIPPED: {var} is not set; this test needs it (run scripts/test, or `{how}` and export {var}) ***\n"
            );
            None
        }
    }
}

/// Panic, naming `var` and its address, when nothing accepts a TCP connection at the
/// host and port of `url` (`scheme://[user[:password]@]host[:port][/...]`) within 3 s: a
/// service that is not running fails the test at once, instead of leaving onceflow
/// retrying it until the test's own deadline.
fn assert_listening(var: &str, url: &str, how: &str, default_port: u16) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let addr = if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host_port.to_string()
    } else {
        format!("{host_port}:{default_port}")
    };
    let resolved: Vec<std::net::SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&addr)
        .unwrap_or_else(|e| panic!("{var}={url}: cannot resolve {addr}: {e}"))
        .collect();
    let ok = resolved.iter().any(|a| {
        std::net::TcpStream::connect_timeout(a, std::time::Duration::from_secs(3)).is_ok()
    });
    assert!(
        ok,
        "{var}={url}: nothing listens at {addr}; start it (`{how}`, or run scripts/test)"
    );
}

/// A private redis-server on a free port, for tests that stop and restart Redis.
pub struct OwnRedis {
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl OwnRedis {
    /// Start one (panics if redis-server is not installed: scripts/redis installs it).
    pub fn start() -> OwnRedis {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut r = OwnRedis {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        r.resume();
        r
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Stop it (SIGKILL: an outage, not a clean shutdown; its append-only file keeps what it
    /// acknowledged).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port.
    pub fn resume(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server not found: run scripts/redis start once (it installs Redis)");
        self.child = Some(child);
        for _ in 0..100 {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not start on port {}", self.port);
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a [`LossyProxy`] does to the first chunk from the client that holds its trigger.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Forward it, give the server 300 ms to run it, then close both sides without passing
    /// the reply back: the client sees its connection drop after its command was sent (the
    /// outcome is unknown to it), while the server ran it.
    LoseReply,
    /// Drop it and close both sides: the server never sees it, and the client cannot tell
    /// this from a lost reply.
    DropRequest,
    /// Hold it this long, then forward it (if the server connection is still open) and
    /// pass the reply on: a request delayed on the network past the client's timeout.
    Delay(Duration),
}

/// A TCP proxy in front of a server that injects one [`Fault`]: the first time a chunk from
/// the client contains `trigger`. Every other byte passes through unchanged.
pub struct LossyProxy {
    pub port: u16,
    /// Faults injected so far (0 or 1).
    pub cuts: Arc<std::sync::atomic::AtomicUsize>,
}

impl LossyProxy {
    /// Listen on a free port, forwarding to `upstream` on 127.0.0.1, losing one reply.
    pub fn start(upstream: u16, trigger: &'static [u8]) -> LossyProxy {
        Self::start_with(upstream, trigger, Fault::LoseReply)
    }

    /// As [`LossyProxy::start`], with another fault.
    pub fn start_with(upstream: u16, trigger: &'static [u8], fault: Fault) -> LossyProxy {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(true));
        let cuts = Arc::new(AtomicUsize::new(0));
        let c2 = cuts.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(up) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let cut = Arc::new(AtomicBool::new(false));
                let (mut c_rd, mut c_wr) = (client.try_clone().unwrap(), client);
                let (mut u_rd, mut u_wr) = (up.try_clone().unwrap(), up);
                let (armed, cuts, cut2) = (armed.clone(), c2.clone(), cut.clone());
                let (c_kill, u_kill) = (c_wr.try_clone().unwrap(), u_rd.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match c_rd.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        let hit = chunk.windows(trigger.len()).any(|w| w == trigger)
                            && armed.swap(false, Ordering::SeqCst);
                        if !hit {
                            if u_wr.write_all(chunk).is_err() {
                                break;
                            }
                            continue;
                        }
                        cuts.fetch_add(1, Ordering::SeqCst);
                        match fault {
                            Fault::LoseReply => {
                                // Mark first: the reply must not get through.
                                cut2.store(true, Ordering::SeqCst);
                                let _ = u_wr.write_all(chunk);
                                std::thread::sleep(Duration::from_millis(300));
                                break;
                            }
                            Fault::DropRequest => break,
                            Fault::Delay(d) => {
                                std::thread::sleep(d);
                                if u_wr.write_all(chunk).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = c_kill.shutdown(std::net::Shutdown::Both);
                    let _ = u_kill.shutdown(std::net::Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match u_rd.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cut.load(Ordering::SeqCst) {
                            continue; // the lost reply
                        }
                        if c_wr.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = c_wr.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        LossyProxy { port, cuts }
    }

    /// Its URL as a Redis URL.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Faults injected so far.
    pub fn cuts(&self) -> usize {
        self.cuts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A sled idempotency store in `dir` (subdirectory `idem`).
pub fn sled(dir: &tempfile::TempDir) -> onceflow::StoreSpec {
    onceflow::StoreSpec::Sled {
        path: Some(dir.path().join("idem")),
    }
}

/// The first header `name` of `r`, as bytes (`None`: absent or null).
pub fn header<'a>(r: &'a onceflow::OutRecord, name: &str) -> Option<&'a [u8]> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
}

/// `onceflow_sink_effects_total` summed per `result` label.
pub fn effects_counted(
    snapshotter: &metrics_util::debugging::Snapshotter,
) -> std::collections::BTreeMap<String, u64> {
    use metrics_util::debugging::DebugValue;
    let mut counted = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let (DebugValue::Counter(n), "onceflow_sink_effects_total") = (value, key.key().name()) {
            let result = key
                .key()
                .labels()
                .find(|l| l.key() == "result")
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            *counted.entry(result).or_insert(0) += n;
        }
    }
    counted
}
