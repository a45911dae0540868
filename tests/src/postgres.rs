//! A real PostgreSQL server for the tests: Debian's `postgresql` binaries (which
//! `./scripts/test` installs), a fresh cluster in a temporary directory on a free loopback port,
//! trust authentication for the user `kvgate`. As root, the server runs as the `postgres` user
//! (PostgreSQL refuses to run as root). Queries go through `psql`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    running: bool,
}

/// The newest installed PostgreSQL's binaries (`/usr/lib/postgresql/N/bin`).
fn bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b).unwrap_or_else(|| {
        panic!("PostgreSQL is missing under /usr/lib/postgresql: run ./scripts/test, which installs it")
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program args` as the `postgres` user when this process is root.
fn as_server_user(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl PostgresServer {
    /// Initializes a cluster and starts it; waits until it accepts queries.
    pub fn start() -> PostgresServer {
        let bin = bin_dir();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("probe a free port")
            .port();
        // As root the server runs as `postgres`, which must reach the directory: /tmp, not a
        // TMPDIR that may be private to root.
        let base = if is_root() {
            PathBuf::from("/tmp")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("kvgate-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("postgres dir");
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown {} to postgres", dir.display());
        }
        let out = as_server_user(&bin.join("initdb"))
            .arg("-D")
            .arg(dir.join("data"))
            .args([
                "-A",
                "trust",
                "-U",
                "kvgate",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = PostgresServer {
            bin,
            dir,
            port,
            running: false,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c synchronous_commit=off",
            self.port,
            self.dir.display()
        );
        let ok = as_server_user(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-o", &options, "-w", "start"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "pg_ctl start on port {}", self.port);
        self.running = true;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.try_query("SELECT 1").as_deref() != Some("1") {
            assert!(
                Instant::now() < deadline,
                "postgres did not start on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://kvgate@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one statement with `psql`; its rows, `|`-separated, one per line.
    pub fn query(&self, sql: &str) -> String {
        self.try_query(sql)
            .unwrap_or_else(|| panic!("psql on port {}: {sql}", self.port))
    }

    pub fn try_query(&self, sql: &str) -> Option<String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args([
                "-U",
                "kvgate",
                "-d",
                "postgres",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Stops the server (a fast shutdown: clients are disconnected); its data stays.
    pub fn stop(&mut self) {
        if std::mem::take(&mut self.running) {
            let _ = as_server_user(&self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "fast", "-w", "stop"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }

    /// Starts it again on the same port, with the same data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
