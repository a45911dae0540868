//! A throwaway `redis-server` for end-to-end tests: one per test, on a free loopback port, no
//! persistence, killed on drop. `stop` and `restart` (same port) let fault tests take Redis away
//! and bring it back; `pause` and `resume` freeze it, so it accepts connections but never answers. [`RedisServer::cmd`] is a tiny blocking RESP client, so tests can inspect
//! and tamper with the keyspace without going through the code under test.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REDIS_SERVER: &str = "/usr/bin/redis-server";

/// A running `redis-server`.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// One RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Nil,
    Int(i64),
    /// A simple or bulk string (bytes, lossily decoded).
    Str(String),
    Error(String),
    Array(Vec<Reply>),
}

impl Reply {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Reply::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn into_array(self) -> Vec<Reply> {
        match self {
            Reply::Array(v) => v,
            other => panic!("expected an array reply, got {other:?}"),
        }
    }
}

impl RedisServer {
    /// Starts a fresh server on a free loopback port and waits until it answers PING.
    pub fn start() -> RedisServer {
        assert!(
            std::path::Path::new(REDIS_SERVER).exists(),
            "{REDIS_SERVER} is missing: run ./scripts/test, which installs redis-server"
        );
        // The port is free when probed; another process could take it before redis binds, so
        // try a few.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("probe a free port")
                .port();
            let dir =
                std::env::temp_dir().join(format!("kvgate-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("redis work dir");
            let mut server = RedisServer {
                port,
                dir,
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// Spawns the process on `self.port`; `false` if it exited or never answered.
    fn spawn(&mut self) -> bool {
        let child = Command::new(REDIS_SERVER)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {REDIS_SERVER}: {e} (run ./scripts/test)"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    self.child = None;
                    return false;
                }
            }
            if self
                .try_cmd(&["PING"])
                .is_ok_and(|r| r == Reply::Str("PONG".into()))
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL: no goodbye to clients, as when a host dies).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A paused server dies on SIGKILL too; thaw it anyway so nothing lingers stopped.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("redis-server is running").id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid} failed");
    }

    /// Starts the server again on the same port, empty (nothing is persisted).
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    /// Runs one command; panics if the server cannot be reached.
    pub fn cmd(&self, args: &[&str]) -> Reply {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("redis {args:?} on port {}: {e}", self.port))
    }

    fn try_cmd(&self, args: &[&str]) -> std::io::Result<Reply> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes())?;
        read_reply(&mut BufReader::new(s))
    }

    /// Every key in the database (SCAN, so it works on any size).
    pub fn keys(&self) -> Vec<String> {
        let mut cursor = "0".to_owned();
        let mut keys = Vec::new();
        loop {
            let mut page = self.cmd(&["SCAN", &cursor, "COUNT", "1000"]).into_array();
            let batch = page.pop().expect("scan keys").into_array();
            keys.extend(
                batch
                    .into_iter()
                    .filter_map(|k| k.as_str().map(str::to_owned)),
            );
            cursor = page[0].as_str().expect("scan cursor").to_owned();
            if cursor == "0" {
                return keys;
            }
        }
    }

    /// A dump of every key's value as text (strings, set and sorted-set members, hash fields and
    /// values), to search for data that must not be there. A key that expired since it was
    /// listed (rate-limit buckets live for seconds) has nothing to dump.
    pub fn dump_values(&self, key: &str) -> Vec<String> {
        let kind = self.cmd(&["TYPE", key]);
        let reply = match kind.as_str() {
            Some("none") => return Vec::new(),
            Some("string") => self.cmd(&["GET", key]),
            Some("set") => self.cmd(&["SMEMBERS", key]),
            Some("zset") => self.cmd(&["ZRANGE", key, "0", "-1", "WITHSCORES"]),
            Some("hash") => self.cmd(&["HGETALL", key]),
            Some("list") => self.cmd(&["LRANGE", key, "0", "-1"]),
            Some("stream") => self.cmd(&["XRANGE", key, "-", "+"]),
            other => panic!("unexpected type {other:?} for {key}"),
        };
        fn flatten(r: Reply, out: &mut Vec<String>) {
            match r {
                Reply::Array(v) => v.into_iter().for_each(|r| flatten(r, out)),
                other => out.extend(other.as_str().map(str::to_owned)),
            }
        }
        match reply {
            r @ Reply::Array(_) => {
                let mut out = Vec::new();
                flatten(r, &mut out);
                out
            }
            Reply::Str(s) => vec![s],
            other => panic!("unexpected value for {key}: {other:?}"),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn read_reply(r: &mut impl BufRead) -> std::io::Result<Reply> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at(line.len().min(1));
    let num = || -> std::io::Result<i64> {
        rest.parse()
            .map_err(|_| std::io::Error::other(format!("bad RESP line {line:?}")))
    };
    Ok(match kind {
        "+" => Reply::Str(rest.to_owned()),
        "-" => Reply::Error(rest.to_owned()),
        ":" => Reply::Int(num()?),
        "$" if num()? < 0 => Reply::Nil,
        "$" => {
            let mut buf = vec![0; num()? as usize + 2];
            r.read_exact(&mut buf)?;
            buf.truncate(buf.len() - 2);
            Reply::Str(String::from_utf8_lossy(&buf).into_owned())
        }
        "*" if num()? < 0 => Reply::Nil,
        "*" => Reply::Array(
            (0..num()?)
                .map(|_| read_reply(r))
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err(std::io::Error::other(format!("bad RESP line {line:?}"))),
    })
}
