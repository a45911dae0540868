//! `kvgate migrate`, `kvgate gateway` and `kvgate admin` as processes: two gateway replicas on
//! one real Redis enforce a tenant's requests/min together, not each on its own.

use kvgate_tests::redis::RedisServer;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const OPERATOR: &str = "operator-token-for-the-cli-test";

fn kvgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.env(
        "KVGATE_HOME",
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/kvgate-test-assets"),
    );
    c
}

fn run(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = kvgate()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kvgate {args:?}: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kvgate gateway` on fresh ports and waits until it listens; returns (api port, admin
/// port, process).
fn gateway(dir: &std::path::Path, redis: &str, n: usize) -> (u16, u16, Proc) {
    let (api, admin, proc) = spawn_gateway(dir, redis, n);
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
        assert!(Instant::now() < deadline, "gateway {n} did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    (api, admin, proc)
}

/// Starts `kvgate gateway` on fresh ports; returns (api port, admin port, process) at once.
fn spawn_gateway(dir: &std::path::Path, redis: &str, n: usize) -> (u16, u16, Proc) {
    let (api, admin) = (free_port(), free_port());
    let path = dir.join(format!("gateway{n}.toml"));
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:{api}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nredis = \"{redis}\"\n\
             model = \"{}\"\npepper = \"a-pepper-shared-by-replicas\"\noperator_token = \"{OPERATOR}\"\n",
            kvgate_tests::smollm2_dir().display()
        ),
    )
    .unwrap();
    let child = kvgate()
        .args(["gateway", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    (api, admin, Proc(child))
}

#[test]
fn a_gateway_started_while_redis_does_not_answer_comes_up_when_it_does() {
    let redis = RedisServer::start();
    let url = redis.url();
    run(&["migrate", "--redis", &url], &[]);
    let dir = tempfile::tempdir().unwrap();
    // A frozen server: connections open, nothing answers (as while Redis restarts, or a
    // network partition heals).
    redis.pause();
    let (_, admin, mut g) = spawn_gateway(dir.path(), &url, 1);
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        g.0.try_wait().unwrap().is_none(),
        "the gateway exited while redis did not answer"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", admin)).is_err(),
        "the gateway listened before its store answered"
    );
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
        assert!(
            g.0.try_wait().unwrap().is_none(),
            "the gateway exited after redis answered again"
        );
        assert!(Instant::now() < deadline, "the gateway did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn two_gateways_share_one_rate_limit() {
    let redis = RedisServer::start();
    let url = redis.url();
    let out = run(&["migrate", "--redis", &url], &[]);
    assert!(out.contains("applied migration 0001"), "{out}");
    let out = run(&["migrate", "--redis", &url], &[]);
    assert!(out.contains("nothing to apply"), "{out}");

    let dir = tempfile::tempdir().unwrap();
    let (api1, admin1, _g1) = gateway(dir.path(), &url, 1);
    let (api2, admin2, _g2) = gateway(dir.path(), &url, 2);

    let admin_url = format!("http://127.0.0.1:{admin1}");
    let env = [
        ("KVGATE_ADMIN_URL", admin_url.as_str()),
        ("KVGATE_OPERATOR_TOKEN", OPERATOR),
    ];
    run(&["admin", "tenants", "create", "lim", "--rpm", "10"], &env);
    let issued: serde_json::Value =
        serde_json::from_str(&run(&["admin", "keys", "issue", "lim"], &env)).unwrap();
    let key = issued["key"].as_str().unwrap().to_owned();

    // 40 requests at once, alternating between the replicas. No engine is registered, so an
    // admitted request ends in 503; a refused one in 429.
    let body = r#"{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"hi"}]}"#;
    let results: Vec<kvgate_tests::Response> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..40)
            .map(|i| {
                let key = &key;
                s.spawn(move || {
                    let port = if i % 2 == 0 { api1 } else { api2 };
                    kvgate_tests::request(
                        ([127, 0, 0, 1], port).into(),
                        "POST",
                        "/v1/chat/completions",
                        &[("authorization", &format!("Bearer {key}"))],
                        body,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let limited: Vec<_> = results.iter().filter(|r| r.status == 429).collect();
    let admitted = results.iter().filter(|r| r.status == 503).count();
    assert_eq!(
        admitted + limited.len(),
        40,
        "{:?}",
        results.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    // Exactly the burst of 10 (one more only if a 6 s emission interval passed mid-test).
    assert!(
        (10..=11).contains(&admitted),
        "admitted {admitted} of 40 across two replicas"
    );
    for r in &limited {
        let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&secs), "{secs}");
        assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    }

    // The ledger has each admitted request (each ended in 503: no engine), whichever replica
    // took it, and the CLI reads it as CSV; the audit log lists what the CLI did.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let csv = run(
            &["admin", "usage", "--tenant", "lim", "--format", "csv"],
            &env,
        );
        let rows: Vec<&str> = csv.lines().collect();
        assert_eq!(
            rows[0],
            "tenant,requests,prompt_tokens,cached_tokens,completion_tokens,cost_usd"
        );
        if rows
            .get(1)
            .is_some_and(|r| r.starts_with(&format!("lim,{admitted},")))
        {
            break;
        }
        assert!(Instant::now() < deadline, "{csv}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let audit = run(&["admin", "audit"], &env);
    for want in ["tenant.create", "key.issue", "tenant:lim", "bootstrap"] {
        assert!(audit.contains(want), "{want} in {audit}");
    }
    let issued: serde_json::Value = serde_json::from_str(&run(
        &["admin", "tokens", "issue", "grafana", "--role", "viewer"],
        &env,
    ))
    .unwrap();
    let viewer = issued["token"].as_str().unwrap();
    let as_viewer = [
        ("KVGATE_ADMIN_URL", admin_url.as_str()),
        ("KVGATE_OPERATOR_TOKEN", viewer),
    ];
    let listed = run(&["admin", "tenants", "list"], &as_viewer);
    assert!(listed.contains("\"lim\""), "{listed}");
    let out = kvgate()
        .args(["admin", "tenants", "create", "nope"])
        .envs(as_viewer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("403"), "{stderr}");

    // The admin CLI sees what the replicas share.
    let listed = run(&["admin", "tenants", "list"], &env);
    assert!(listed.contains("\"lim\""), "{listed}");

    // An engine added through one replica reaches the other through the store, and so does its
    // removal.
    let admin2_url = format!("http://127.0.0.1:{admin2}");
    let env2 = [
        ("KVGATE_ADMIN_URL", admin2_url.as_str()),
        ("KVGATE_OPERATOR_TOKEN", OPERATOR),
    ];
    run(
        &["admin", "engines", "add", "far", "http://127.0.0.1:9"],
        &env,
    );
    let until = |env: &[(&str, &str)], present: bool| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let list = run(&["admin", "engines", "list"], env);
            if list.contains("\"far\"") == present {
                return;
            }
            assert!(Instant::now() < deadline, "registry sync: {list}");
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    until(&env2, true);
    run(&["admin", "engines", "remove", "far"], &env2);
    until(&env, false);

    // The API threads share their port among themselves only: a gateway started on a port in
    // use fails, as a single listener would, instead of taking part of its traffic.
    let path = dir.path().join("gateway1.toml");
    let clash = dir.path().join("clash.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &clash,
        text.replace(
            &format!("127.0.0.1:{admin1}"),
            &format!("127.0.0.1:{}", free_port()),
        ),
    )
    .unwrap();
    let out = kvgate()
        .args(["gateway", "--config"])
        .arg(&clash)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a second gateway took port {api1}: {stderr}"
    );
    assert!(stderr.contains("binding"), "{stderr}");
}
