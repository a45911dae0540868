//! The prefix cache's slower tiers end to end, on the real model: a prompt evicted from the KV
//! pool comes back from host memory, and from disk after a restart, with exactly the output it
//! has when computed; a corrupted disk block is caught by its checksum and recomputed, never
//! served; a flush reaches the files; another deployment's directory is refused; a full disk
//! turns the tier off and nothing else; tenants never share a block in any tier.

use kvgate_engine::server::{config::EngineConfig, launch};
use kvgate_tests::{smollm2_dir, Engine, Response};
use serde_json::Value;
use std::path::Path;

const SEED: &str = "0101010101010101010101010101010101010101010101010101010101010101";

/// A prompt of about 200 tokens (13 blocks of 16), different for each `topic`.
fn long_prompt(topic: &str) -> String {
    let mut s = format!("You are a careful assistant for questions about {topic}. ");
    for i in 0..12 {
        s.push_str(&format!(
            "Rule {i}: answer about {topic} plainly, cite no sources, and keep to the point. "
        ));
    }
    s.push_str("Now say one word.");
    s
}

fn ask(e: &Engine, prompt: &str) -> (String, u64) {
    let r: Response = e.chat(prompt, r#","max_tokens":6"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let j: Value = r.json();
    let text = j["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (text, cached)
}

/// Fills a 20-block pool with two other long prompts, so the first one's blocks are reused.
fn evict(e: &Engine) {
    ask(e, &long_prompt("volcanoes"));
    ask(e, &long_prompt("glaciers"));
}

fn kvb_files(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "kvb"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn an_evicted_prompt_comes_back_from_host_memory_with_the_same_output() {
    let prompt = long_prompt("rivers");
    // Without a host tier the evicted prompt is computed again.
    let plain = Engine::start("[kv]\nblocks = 20");
    let (want, _) = ask(&plain, &prompt);
    evict(&plain);
    let (again, cached) = ask(&plain, &prompt);
    assert_eq!(again, want);
    assert!(
        cached < 64,
        "the pool is too small to keep it, yet {cached} were cached"
    );
    drop(plain);

    let tiered = Engine::start("[kv]\nblocks = 20\nhost_cache_blocks = 64");
    let (first, _) = ask(&tiered, &prompt);
    assert_eq!(first, want);
    evict(&tiered);
    assert!(tiered.metric("kvgate_kv_tier_demotions_total{tier=\"host\"}") > 0.0);
    let (back, cached) = ask(&tiered, &prompt);
    assert_eq!(
        back, want,
        "promoted blocks must hold exactly the computed KV"
    );
    assert!(
        cached >= 176,
        "only {cached} tokens came back from the host tier"
    );
    assert!(tiered.metric("kvgate_kv_tier_hit_tokens_total{tier=\"host\"}") >= 176.0);
    let status = tiered.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "{status}");
    assert!(
        status["tiers"]["host_blocks"].as_u64().unwrap_or(0) > 0,
        "{status}"
    );
}

#[test]
fn the_disk_tier_survives_a_restart_and_never_serves_a_corrupt_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "[kv]\nblocks = 20\nhash_seed = \"{SEED}\"\ndisk_dir = {:?}\ndisk_bytes = 1073741824",
        dir.path().display().to_string()
    );
    let prompt = long_prompt("rivers");
    let want = {
        let e = Engine::start(&config);
        let (want, _) = ask(&e, &prompt);
        // A drain persists the cache to disk while the engine keeps running (and so does a
        // stop, after it).
        let r = e.admin("POST", "/admin/drain", "");
        assert_eq!(r.status, 200, "{}", r.body);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while kvb_files(dir.path()).len() < 12 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(
            kvb_files(dir.path()).len() >= 12,
            "the drain did not persist the prompt's blocks"
        );
        let status = e.admin("GET", "/admin/status", "").json();
        assert!(
            status["tiers"]["saved_blocks"].as_u64().unwrap_or(0) >= 12,
            "{status}"
        );
        want
    };
    assert!(
        kvb_files(dir.path()).len() >= 12,
        "the prompt's blocks were not persisted"
    );

    // Restarted, the engine finds them and the prompt's prefill is a load, not a computation.
    {
        let e = Engine::start(&config);
        let (text, cached) = ask(&e, &prompt);
        assert_eq!(
            text, want,
            "blocks read from disk must hold exactly the computed KV"
        );
        assert!(cached >= 176, "only {cached} tokens came back from disk");
        assert!(e.metric("kvgate_kv_tier_hit_tokens_total{tier=\"disk\"}") >= 176.0);
        assert!(e.metric("kvgate_kv_tier_disk_loads_total") >= 1.0);
    }

    // Every file damaged: the checksums catch it, the blocks are deleted and recomputed.
    for path in kvb_files(dir.path()) {
        let mut raw = std::fs::read(&path).expect("read");
        let n = raw.len();
        raw[n / 2] ^= 0x40;
        std::fs::write(&path, raw).expect("write");
    }
    {
        let e = Engine::start(&config);
        let (text, cached) = ask(&e, &prompt);
        assert_eq!(text, want);
        assert_eq!(cached, 0, "a corrupt block was served");
        assert!(e.metric("kvgate_kv_tier_corrupt_blocks_total") >= 1.0);
        // The flush reaches the disk: its files go.
        let r = e.admin("POST", "/admin/cache/flush", "");
        assert_eq!(r.status, 200, "{}", r.body);
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(kvb_files(dir.path()).is_empty(), "flushed files remain");
    }

    // Another hash seed is another deployment: its engine refuses the directory, by name.
    let other = config.replace(SEED, &"02".repeat(32));
    let mut parsed = EngineConfig::parse(&other).expect("config");
    parsed.model_id = Some(kvgate_tests::MODEL.into());
    let err = launch::start(&parsed, &smollm2_dir())
        .expect_err("a directory of another deployment is refused")
        .to_string();
    assert!(err.contains("another deployment"), "{err}");
}

/// A greedy chat as the gateway sends it (engine token, tenancy headers), with `extra` headers.
fn gated_ask(e: &Engine, scope: &str, prompt: &str, extra: &[(&str, &str)]) -> (String, u64) {
    gated_answer(e, scope, prompt, extra, 6)
}

/// The peer hint the gateway sends with a request routed away from `peer` (a holder, or one
/// still `computing` the blocks), as header names and values.
fn gateway_hint(peer: &str, computing: bool) -> Vec<(String, String)> {
    let named = kvgate_gateway::upstream::peer::Peer {
        slot: 0,
        blocks: 64,
        computing,
    };
    (named.headers(peer.parse().unwrap()))
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
        .collect()
}

/// `headers` as the pairs [`gated_ask`] takes.
fn pairs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect()
}

/// [`gated_ask`], with an answer of up to `max_tokens`.
fn gated_answer(
    e: &Engine,
    scope: &str,
    prompt: &str,
    extra: &[(&str, &str)],
    max_tokens: u32,
) -> (String, u64) {
    use kvgate_tests::gateway::ENGINE_TOKEN;
    let auth = format!("Bearer {ENGINE_TOKEN}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("x-kvgate-tenant", scope),
        ("x-kvgate-scope", scope),
    ];
    headers.extend_from_slice(extra);
    let body = format!(
        r#"{{"model":"{}","messages":[{{"role":"user","content":{}}}],"temperature":0,"max_tokens":{max_tokens}}}"#,
        kvgate_tests::MODEL,
        Value::String(prompt.into())
    );
    let r = kvgate_tests::request(e.addr, "POST", "/v1/chat/completions", &headers, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    (
        j["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        j["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

#[test]
fn a_prefix_comes_from_the_peer_that_holds_it_and_a_bad_peer_costs_only_a_recompute() {
    use kvgate_tests::gateway::gated_engine;
    let prompt = long_prompt("rivers");
    let holder = gated_engine("blocks = 64");
    let (want, _) = gated_ask(&holder, "acme", &prompt, &[]);
    let peer = format!("http://{}", holder.addr);

    // A fresh engine told where the prefix lives (the hint as the gateway writes it) fetches
    // it instead of computing it.
    let taker = gated_engine("blocks = 64\nhost_cache_blocks = 64");
    let holds = gateway_hint(&peer, false);
    let (got, cached) = gated_ask(&taker, "acme", &prompt, &pairs(&holds));
    assert_eq!(
        got, want,
        "fetched blocks must hold exactly the computed KV"
    );
    assert!(cached >= 176, "only {cached} tokens came from the peer");
    assert!(taker.metric("kvgate_kv_tier_hit_tokens_total{tier=\"peer\"}") >= 176.0);
    assert_eq!(fetches(&taker, "complete"), 1.0);
    // Its load report gives the fetch's measured time per block (one more for the ask), which
    // the gateway prices its fetches with.
    let status = taker.admin("GET", "/admin/status", "").json();
    let rate = status["load"]["peer_load_secs_per_block"]
        .as_f64()
        .unwrap_or(0.0);
    let (secs, blocks) = (
        status["tiers"]["peer_seconds"].as_f64().unwrap_or(0.0),
        status["tiers"]["peer_blocks"].as_f64().unwrap_or(0.0),
    );
    assert!(blocks >= 11.0, "{status}");
    assert!(rate > 0.0 && rate < 1.0, "{status}");
    assert!((rate - secs / (blocks + 1.0)).abs() < 1e-9, "{status}");
    let gauge = taker.metric("kvgate_kv_peer_fetch_seconds_per_block");
    assert!((gauge - rate).abs() < 1e-9, "{gauge} against {rate}");
    let holder_status = holder.admin("GET", "/admin/status", "").json();
    assert_eq!(
        holder_status["load"]["peer_load_secs_per_block"], 0.0,
        "an engine that never fetched measured a rate: {holder_status}"
    );
    // A fetch from a peer the gateway says is still computing the blocks waits for its steps:
    // it is not counted in the rate.
    let waiter = gated_engine("blocks = 64\nhost_cache_blocks = 64");
    let computing = gateway_hint(&peer, true);
    let (got, cached) = gated_ask(&waiter, "acme", &prompt, &pairs(&computing));
    assert_eq!((got.as_str(), cached >= 176), (want.as_str(), true));
    let status = waiter.admin("GET", "/admin/status", "").json();
    assert_eq!(status["load"]["peer_load_secs_per_block"], 0.0, "{status}");
    assert!(
        status["tiers"]["peer_blocks"].as_u64().unwrap_or(0) >= 11,
        "{status}"
    );

    // Another tenant's request, with the same text and the same hint, gets nothing: the peer
    // holds no block of its scope.
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (_, cached) = gated_ask(&taker, "globex", &prompt, &hint);
    assert_eq!(
        cached, 0,
        "a scope hit another scope's blocks through a peer"
    );

    // A peer that is not there, or not an engine, costs a recompute and nothing else.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let junk = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let junk_url = format!("http://{}", junk.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for s in junk.incoming().flatten().take(4) {
            let mut s = s;
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let body = vec![0x5au8; 4096];
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(&body);
        }
    });
    for url in [&dead_url, &junk_url] {
        let fresh = gated_engine("blocks = 64\nhost_cache_blocks = 64");
        let (got, cached) = gated_ask(&fresh, "acme", &prompt, &[("x-kvgate-prefix-peer", url)]);
        assert_eq!(got, want);
        assert_eq!(cached, 0, "{url}: a block from a bad peer was served");
        assert_eq!(
            fresh.metric("kvgate_kv_tier_hit_tokens_total{tier=\"peer\"}"),
            0.0
        );
        // A fetch that brought nothing measures no rate.
        let status = fresh.admin("GET", "/admin/status", "").json();
        assert_eq!(status["load"]["peer_load_secs_per_block"], 0.0, "{status}");
        // Named again at once for another prompt, the peer is not asked: it failed moments ago.
        let other = long_prompt("lakes");
        gated_ask(&fresh, "acme", &other, &[("x-kvgate-prefix-peer", url)]);
        assert_eq!(fetches(&fresh, "held_off"), 1.0, "{url} was asked again");
    }

    // The transfer endpoint is the engines' own: no token, no blocks.
    let body = r#"{"scope":"acme","tokens":[1,2,3],"from":0}"#;
    let r = kvgate_tests::request(holder.addr, "POST", "/kv/blocks", &[], body);
    assert_eq!(r.status, 401, "{}", r.body);
    // With the token, it still takes the prompt, not hashes: hashes alone are a 400, and tokens
    // of a prompt it does not hold bring nothing.
    use kvgate_tests::gateway::ENGINE_TOKEN;
    let auth = format!("Bearer {ENGINE_TOKEN}");
    let with_token = [("authorization", auth.as_str())];
    let r = kvgate_tests::request(
        holder.addr,
        "POST",
        "/kv/blocks",
        &with_token,
        r#"{"hashes":["00000000000000000000000000000001"]}"#,
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let tokens: Vec<String> = (0..64).map(|i| (1000 + i).to_string()).collect();
    let body = format!(
        r#"{{"scope":"acme","tokens":[{}],"from":0}}"#,
        tokens.join(",")
    );
    let r = kvgate_tests::request(holder.addr, "POST", "/kv/blocks", &with_token, &body);
    assert_eq!(
        (r.status, r.body.len()),
        (200, 0),
        "blocks for a prompt it never saw"
    );
}

/// A system prompt of `rules` similar sentences and a short question.
fn tides_prompt(rules: usize) -> String {
    let mut prompt = String::from("You are a careful assistant for questions about tides. ");
    for i in 0..rules {
        prompt.push_str(&format!(
            "Rule {i}: answer about tides plainly, cite no sources, and keep to the point. "
        ));
    }
    prompt.push_str("Now say one word.");
    prompt
}

/// Waits until engine `e` has `n` KV blocks in use (a prefill it started has allocated them).
fn wait_for_blocks(e: &Engine, n: usize) {
    let started = std::time::Instant::now();
    while e.metric("kvgate_kv_blocks{state=\"used\"}") < n as f64 {
        assert!(
            started.elapsed().as_secs() < 120,
            "the engine never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A holder engine of 128 blocks with these `[scheduler]` settings, and the hint that names it
/// as the peer (its base URL).
fn holder(scheduler: &str) -> (Engine, String) {
    let e = kvgate_tests::gateway::gated_engine(&format!("blocks = 128\n[scheduler]\n{scheduler}"));
    let peer = format!("http://{}", e.addr);
    (e, peer)
}

/// An engine of 128 blocks with a host tier of as many, to fetch into.
fn new_taker() -> Engine {
    kvgate_tests::gateway::gated_engine("blocks = 128\nhost_cache_blocks = 128")
}

/// How many of `e`'s peer fetches ended with `result`.
fn fetches(e: &Engine, result: &str) -> f64 {
    e.metric(&format!(
        "kvgate_kv_peer_fetches_total{{result=\"{result}\"}}"
    ))
}

/// A peer answers a fetch while it computes (between the layers of a step), and never sends a
/// block before a step has computed it: a taker that fetches a prompt while its holder is part
/// way through it (two blocks a step) waits for the blocks still being computed, and answers
/// exactly as the holder does.
#[test]
fn a_peer_computing_the_prompt_sends_only_what_it_has_computed() {
    let prompt = tides_prompt(40);
    // Two blocks a step: the holder takes many steps over the prompt, and each one writes blocks
    // of it.
    let (holder, peer) = holder("max_batched_tokens = 32");
    let taker = new_taker();
    let want = std::thread::scope(|scope| {
        let computing = scope.spawn(|| gated_ask(&holder, "acme", &prompt, &[]));
        // Once the holder has allocated its fourth block, its first two are computed.
        wait_for_blocks(&holder, 4);
        let hint = [("x-kvgate-prefix-peer", peer.as_str())];
        let (got, cached) = gated_ask(&taker, "acme", &prompt, &hint);
        let (want, _) = computing.join().unwrap();
        assert_eq!(got, want, "a block the holder had not computed was sent");
        assert!(cached >= 32, "only {cached} tokens came from the peer");
        assert!(
            holder.metric("kvgate_kv_peer_export_waits_total") >= 1.0,
            "no ask waited for the holder's prefill"
        );
        want
    });
    // The whole prompt, once computed, comes over in full.
    let again = new_taker();
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (got, cached) = gated_ask(&again, "acme", &prompt, &hint);
    assert_eq!(got, want);
    assert!(cached >= 600, "only {cached} tokens came from the peer");
}

/// A taker in the middle of a long step starts a fetch at once: its engine thread says what to
/// fetch between the layers of that step, not after it, so the blocks come while the step runs
/// and the request is admitted when it ends, as it would have been without a fetch.
#[test]
fn a_taker_busy_with_a_long_step_fetches_while_the_step_runs() {
    let prompt = tides_prompt(14);
    let (holder, peer) = holder("max_batched_tokens = 2048");
    let (want, _) = gated_ask(&holder, "acme", &prompt, &[]);
    let taker = kvgate_tests::gateway::gated_engine(
        "blocks = 160\nhost_cache_blocks = 128\n[scheduler]\nmax_batched_tokens = 2048",
    );
    // A first step is slow (its memory is touched for the first time): not this one's.
    gated_ask(&taker, "warm", &tides_prompt(40), &[]);
    // About 1,650 tokens (103 blocks) in another scope, computed in one step of several
    // seconds on a CPU.
    let long = tides_prompt(90);
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (prefill, got, cached) = std::thread::scope(|scope| {
        let busy = scope.spawn(|| {
            let started = std::time::Instant::now();
            gated_answer(&taker, "other", &long, &[], 1);
            started.elapsed().as_secs_f64()
        });
        // Well into that step. Answered only after it, the fetch would wait past its time
        // limit (1.5 s for 19 blocks) and bring nothing.
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let (got, cached) = gated_ask(&taker, "acme", &prompt, &hint);
        (busy.join().unwrap(), got, cached)
    });
    assert_eq!(got, want);
    assert!(cached >= 208, "only {cached} tokens came from the peer");
    assert_eq!(
        fetches(&taker, "complete") + fetches(&taker, "partial"),
        1.0
    );
    let fetch = taker.metric("kvgate_kv_tier_load_seconds_total{tier=\"peer\"}");
    assert!(
        prefill > 1.5 + fetch,
        "the {prefill:.3} s prefill ended before the fetch: the test needs a longer one"
    );
    assert!(
        fetch < prefill / 8.0,
        "the fetch took {fetch:.3} s beside a {prefill:.3} s prefill"
    );
}

/// A request sent to one engine while another computes its prompt copies the whole prompt
/// once that prefill ends, instead of computing what the holder had not reached when it asked:
/// it gets as many cached tokens as from a holder that had finished, and the same answer.
#[test]
fn a_fetch_from_a_peer_in_prefill_waits_for_the_whole_prompt() {
    let prompt = tides_prompt(14);
    let (holder, peer) = holder("max_batched_tokens = 64");
    // Both takers start before the holder computes anything: an engine takes a while to load.
    let [early_taker, late_taker] = [(); 2].map(|_| new_taker());
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (early, early_cached, want) = std::thread::scope(|scope| {
        let computing = scope.spawn(|| gated_ask(&holder, "acme", &prompt, &[]));
        // Four blocks a step: once the fourth block is taken, most of the prompt is still to
        // be computed.
        wait_for_blocks(&holder, 4);
        let (got, cached) = gated_ask(&early_taker, "acme", &prompt, &hint);
        (got, cached, computing.join().unwrap().0)
    });
    assert!(
        holder.metric("kvgate_kv_peer_export_waits_total") >= 1.0,
        "the fetch never waited for the holder's prefill"
    );
    let (late, late_cached) = gated_ask(&late_taker, "acme", &prompt, &hint);
    assert_eq!(
        (early.as_str(), late.as_str()),
        (want.as_str(), want.as_str())
    );
    assert!(
        late_cached >= 208,
        "only {late_cached} tokens from a finished holder"
    );
    assert_eq!(
        early_cached, late_cached,
        "a fetch during the holder's prefill brought less than one after it"
    );
}

/// Waits until engine `e` has `n` sequence groups waiting in its queue.
fn wait_for_queued(e: &Engine, n: usize) {
    let started = std::time::Instant::now();
    while e.metric("kvgate_sequences{state=\"waiting\"}") < n as f64 {
        assert!(started.elapsed().as_secs() < 120, "nothing was queued");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A holder that has a prompt in its queue (its batch is full) computes it later: a fetch of
/// that prompt waits for it, rather than computing it a second time, and gets the blocks as the
/// holder computes them, and the same answer. (How many arrive before the fetch's time limit
/// depends on the machine's speed: on a loaded one, the holder's queue can outlast it.)
#[test]
fn a_fetch_waits_for_a_prompt_in_the_holders_queue() {
    let (first, queued) = (tides_prompt(6), long_prompt("glaciers"));
    // One sequence at a time: the first request's answer keeps the holder busy while the second
    // waits in its queue.
    let (holder, peer) = holder("max_seqs = 1\nmax_batched_tokens = 64");
    let taker = new_taker();
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (got, cached, want) = std::thread::scope(|scope| {
        let busy = scope.spawn(|| gated_answer(&holder, "acme", &first, &[], 8));
        wait_for_blocks(&holder, 2);
        let computing = scope.spawn(|| gated_ask(&holder, "acme", &queued, &[]));
        wait_for_queued(&holder, 1);
        let (got, cached) = gated_ask(&taker, "acme", &queued, &hint);
        busy.join().unwrap();
        (got, cached, computing.join().unwrap().0)
    });
    assert!(
        holder.metric("kvgate_kv_peer_export_waits_total") >= 1.0,
        "the fetch never waited for the queued prompt"
    );
    assert_eq!(got, want);
    let results: Vec<(&str, f64)> = ["complete", "partial", "timed_out", "failed", "busy"]
        .into_iter()
        .map(|r| (r, fetches(&taker, r)))
        .collect();
    // Asked while the prompt was queued, the holder answered once it computed the blocks:
    // without the wait it answers at once with nothing.
    assert!(
        cached >= 16,
        "{cached} tokens came from the peer: {results:?}"
    );
    assert_eq!(
        results[0].1 + results[2].1,
        1.0,
        "the fetch ended other than complete or cut by its limit: {cached} {results:?}"
    );
}

/// Requests for one prompt sent together to an engine, each told to fetch it from the same
/// peer while that peer computes it, share one transfer: one fetches, the others wait for it,
/// and every one is served from the blocks it brought, with the same answer as the holder's.
#[test]
fn requests_that_want_the_same_blocks_share_one_transfer() {
    let prompt = tides_prompt(14);
    // Two blocks a step: the holder computes the prompt over many steps, so the first transfer
    // is still running when the other requests ask.
    let (holder, peer) = holder("max_batched_tokens = 32");
    let taker = new_taker();
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (answers, want) = std::thread::scope(|scope| {
        let computing = scope.spawn(|| gated_ask(&holder, "acme", &prompt, &[]));
        wait_for_blocks(&holder, 2);
        let asks: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| gated_ask(&taker, "acme", &prompt, &hint)))
            .collect();
        let answers: Vec<(String, u64)> = asks.into_iter().map(|a| a.join().unwrap()).collect();
        (answers, computing.join().unwrap().0)
    });
    for (got, cached) in &answers {
        assert_eq!(got, &want);
        assert!(*cached >= 208, "only {cached} tokens cached: {answers:?}");
    }
    let result = |r: &str| fetches(&taker, r);
    assert_eq!(
        holder.metric("kvgate_kv_peer_exports_total{result=\"served\"}"),
        1.0,
        "the blocks were sent more than once"
    );
    assert_eq!(result("refused"), 0.0, "a request found no transfer slot");
    assert_eq!(result("complete") + result("joined"), 4.0);
}

/// The gateway says how many of the prompt's leading blocks to fetch: no block past them is
/// asked for, and an engine that holds as many asks for nothing. A count that is not a number is
/// ignored (the fetch asks for all it misses).
#[test]
fn a_fetch_asks_for_no_block_past_the_hints_count() {
    let (holder, peer) = holder("");
    let long = tides_prompt(12);
    let (want, _) = gated_ask(&holder, "acme", &long, &[]);
    let hint = |count: &'static str| {
        [
            ("x-kvgate-prefix-peer", peer.as_str()),
            ("x-kvgate-prefix-peer-blocks", count),
        ]
    };
    let taker = new_taker();
    let (got, cached) = gated_ask(&taker, "acme", &long, &hint("5"));
    assert_eq!(got, want);
    assert_eq!(cached, 80, "asked for five blocks, {cached} tokens came");
    assert_eq!(fetches(&taker, "complete"), 1.0);

    // An engine holding the prompt's first blocks (a shorter prompt's) asks for nothing more.
    let own = new_taker();
    gated_ask(&own, "acme", &tides_prompt(4), &[]);
    let (got, cached) = gated_ask(&own, "acme", &long, &hint("2"));
    assert_eq!(got, want);
    assert!(
        (32..176).contains(&cached),
        "{cached} tokens cached: not its own blocks alone"
    );
    assert_eq!(
        fetches(&own, "complete") + fetches(&own, "partial"),
        0.0,
        "asked a peer for blocks past the count"
    );
    // Nor does a fresh one told to fetch none.
    let fresh = new_taker();
    assert_eq!(
        gated_ask(&fresh, "acme", &long, &hint("0")),
        (want.clone(), 0)
    );

    let junk = new_taker();
    let (got, cached) = gated_ask(&junk, "acme", &long, &hint("all of them"));
    assert_eq!(got, want);
    assert!(cached >= 176, "only {cached} tokens came from the peer");
}

/// A request told to fetch while both of its engine's transfer slots are taken (two other
/// prompts, which their holder is still computing) waits for a slot, and fetches its prompt
/// rather than computing it. (It waits only while the transfer would end before computing the
/// prompt would: about 680 tokens here, which the holder's two short prefills end well within.)
#[test]
fn a_fetch_waits_for_a_transfer_slot() {
    let ready = tides_prompt(40);
    let slow = [long_prompt("glaciers"), long_prompt("deserts")];
    // One block a step: the holder takes many steps over the two slow prompts.
    let (holder, peer) = holder("max_batched_tokens = 16");
    let (want, _) = gated_ask(&holder, "acme", &ready, &[]);
    let taker = new_taker();
    // The prompts' shared leading blocks (the chat template's, and the first words), computed
    // on the taker: each fetch then starts at a block of its own, and none joins another's
    // transfer.
    gated_ask(&taker, "acme", &long_prompt("tundra"), &[]);
    let hint = [("x-kvgate-prefix-peer", peer.as_str())];
    let (got, cached) = std::thread::scope(|scope| {
        let computing: Vec<_> = slow
            .iter()
            .map(|p| scope.spawn(|| gated_ask(&holder, "acme", p, &[])))
            .collect();
        wait_for_sequences(&holder, 2);
        // Both of the taker's transfer slots, each waiting for the holder's prefill.
        let fetching: Vec<_> = slow
            .iter()
            .map(|p| scope.spawn(|| gated_ask(&taker, "acme", p, &hint)))
            .collect();
        let started = std::time::Instant::now();
        while taker.metric("kvgate_kv_peer_transfers{role=\"fetching\"}") < 2.0 {
            assert_eq!(
                holder.metric("kvgate_kv_peer_exports_total{result=\"served\"}"),
                0.0,
                "a transfer ended before both ran: the test needs a slower holder"
            );
            assert!(started.elapsed().as_secs() < 120, "the fetches never ran");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let asked = gated_ask(&taker, "acme", &ready, &hint);
        for t in computing.into_iter().chain(fetching) {
            t.join().unwrap();
        }
        asked
    });
    assert_eq!(got, want);
    assert_eq!(fetches(&taker, "refused"), 0.0, "the request found no slot");
    assert!(cached >= 600, "only {cached} tokens cached");
    assert_eq!(
        fetches(&taker, "joined"),
        0.0,
        "the test needs transfers of their own"
    );
}

/// Waits until engine `e` has `n` sequence groups running or waiting.
fn wait_for_sequences(e: &Engine, n: usize) {
    let started = std::time::Instant::now();
    while e.metric("kvgate_sequences{state=\"running\"}")
        + e.metric("kvgate_sequences{state=\"waiting\"}")
        < n as f64
    {
        assert!(started.elapsed().as_secs() < 120, "nothing was scheduled");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// A requester that leaves while its ask waits for the holder to compute a block frees the
/// holder's transfer slot within moments, not at the transfer's 30 s deadline: the holder serves
/// two transfers at a time, and two abandoned waits must not refuse the next peer. (Here the
/// holder keeps computing, so the next frame's failed write would also end the transfer; the
/// transfer also ends as soon as its stream closes, for a wait that produces no frame.)
#[test]
fn an_abandoned_wait_frees_the_holders_transfer_slot() {
    use kvgate_tests::gateway::{gated_engine, ENGINE_TOKEN};
    use std::io::{Read, Write};
    // One block a step over a 60-block prompt: the holder computes for many steps.
    let holder = gated_engine(
        "blocks = 256
[scheduler]
max_batched_tokens = 16",
    );
    let tokens: Vec<String> = (0..960)
        .map(|i| (1000 + i * 7 % 3000).to_string())
        .collect();
    let tokens = tokens.join(",");
    let auth = format!("Bearer {ENGINE_TOKEN}");
    let headers = [
        ("authorization", auth.as_str()),
        ("x-kvgate-tenant", "acme"),
        ("x-kvgate-scope", "acme"),
    ];
    let completion = format!(
        r#"{{"model":"{}","prompt":[{tokens}],"max_tokens":1,"temperature":0}}"#,
        kvgate_tests::MODEL
    );
    let ask = format!(r#"{{"scope":"acme","tokens":[{tokens}],"from":0}}"#);
    std::thread::scope(|scope| {
        let computing = scope.spawn(|| {
            kvgate_tests::request(
                holder.addr,
                "POST",
                "/v1/completions",
                &headers,
                &completion,
            )
        });
        wait_for_blocks(&holder, 4);
        // Two transfers that wait for the prompt's later blocks, then leave.
        for _ in 0..2 {
            let mut s = std::net::TcpStream::connect(holder.addr).expect("connect");
            let head = format!(
                "POST /kv/blocks HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                ask.len()
            );
            s.write_all(head.as_bytes()).expect("write");
            s.write_all(ask.as_bytes()).expect("write");
            let mut first = [0u8; 12];
            s.read_exact(&mut first).expect("status line");
            assert!(
                first.starts_with(b"HTTP/1.1 200"),
                "{:?}",
                String::from_utf8_lossy(&first)
            );
            drop(s);
        }
        // The next peer is served, while the holder is still computing.
        let started = std::time::Instant::now();
        let mut status = 0;
        while started.elapsed().as_secs() < 3 {
            let s = std::net::TcpStream::connect(holder.addr).expect("connect");
            drop(s);
            let r = kvgate_tests::request(
                holder.addr,
                "POST",
                "/kv/blocks",
                &[("authorization", auth.as_str())],
                r#"{"scope":"acme","tokens":[1,2,3],"from":0}"#,
            );
            status = r.status;
            if status == 200 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(
            !computing.is_finished(),
            "the holder finished before the check"
        );
        assert_eq!(
            status, 200,
            "abandoned waits still hold the holder's transfer slots"
        );
        assert_eq!(computing.join().unwrap().status, 200);
    });
}

/// A tenant's blocks serve only its own scope in every tier: another tenant asking the same
/// prompt computes it, whether the blocks sit in the pool, in host memory, or on disk after a
/// restart, and gets exactly the same output.
#[test]
fn tenants_never_share_a_block_in_any_tier() {
    use kvgate_tests::gateway::gated_engine;
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = format!(
        "blocks = 20\nhost_cache_blocks = 64\ndisk_dir = {:?}",
        dir.path().display().to_string()
    );
    let prompt = long_prompt("rivers");
    let want = {
        let e = gated_engine(&kv);
        let (want, _) = gated_ask(&e, "acme", &prompt, &[]);
        // In the pool.
        let (got, cached) = gated_ask(&e, "globex", &prompt, &[]);
        assert_eq!((got.as_str(), cached), (want.as_str(), 0), "pool");
        // In host memory: both scopes' blocks are evicted from the 20-block pool.
        for topic in ["volcanoes", "glaciers"] {
            gated_ask(&e, "hooli", &long_prompt(topic), &[]);
        }
        assert!(e.metric("kvgate_kv_tier_demotions_total{tier=\"host\"}") > 0.0);
        let (got, cached) = gated_ask(&e, "initech", &prompt, &[]);
        assert_eq!((got.as_str(), cached), (want.as_str(), 0), "host tier");
        let (got, cached) = gated_ask(&e, "acme", &prompt, &[]);
        assert_eq!(got, want);
        assert!(cached >= 176, "the owner got only {cached} tokens back");
        want
        // Stopping persists every scope's blocks to disk.
    };
    assert!(kvb_files(dir.path()).len() >= 12, "nothing was persisted");
    let e = gated_engine(&kv);
    let (got, cached) = gated_ask(&e, "umbrella", &prompt, &[]);
    assert_eq!((got.as_str(), cached), (want.as_str(), 0), "disk tier");
    let (got, cached) = gated_ask(&e, "acme", &prompt, &[]);
    assert_eq!(got, want);
    assert!(
        cached >= 176,
        "the owner got only {cached} tokens back from disk"
    );
}

/// A disk that fills up turns the disk tier off, with its gauge at 0 (the alert's signal), and
/// nothing else: requests keep their outputs, the host tier goes on, a flush still answers.
/// The disk is a 2 MiB tmpfs (`KVGATE_TEST_FULL_DISK`, which scripts/test mounts): a real
/// ENOSPC after two blocks, far under the tier's configured 1 GiB.
#[test]
fn a_full_disk_turns_the_tier_off_and_nothing_else() {
    let Ok(mount) = std::env::var("KVGATE_TEST_FULL_DISK") else {
        eprintln!("SKIPPED: set KVGATE_TEST_FULL_DISK to a small tmpfs (scripts/test mounts one)");
        return;
    };
    let dir = Path::new(&mount).join(format!("run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = format!(
        "[kv]\nblocks = 20\nhost_cache_blocks = 16\nhash_seed = \"{SEED}\"\n\
         disk_dir = {:?}\ndisk_bytes = 1073741824",
        dir.display().to_string()
    );
    let prompt = long_prompt("rivers");
    let e = Engine::start(&config);
    assert_eq!(e.metric("kvgate_kv_tier_disk_up "), 1.0);
    let (want, _) = ask(&e, &prompt);
    // Three prompts of 13 blocks through a 20-block pool and a 16-block host tier: blocks spill
    // to disk, and the third file does not fit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for topic in ["volcanoes", "glaciers", "deserts", "forests"] {
        ask(&e, &long_prompt(topic));
        if e.metric("kvgate_kv_tier_disk_up ") == 0.0 {
            break;
        }
    }
    while e.metric("kvgate_kv_tier_disk_up ") != 0.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        e.metric("kvgate_kv_tier_disk_up "),
        0.0,
        "a full disk must turn the tier off"
    );
    // The engine goes on: the same output, the host tier still serving, a flush answering.
    let (again, _) = ask(&e, &prompt);
    assert_eq!(again, want);
    let r = e.admin("GET", "/admin/status", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = e.admin("POST", "/admin/cache/flush", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let health = kvgate_tests::request(e.addr, "GET", "/health", &[], "");
    assert_eq!(health.status, 200);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}
