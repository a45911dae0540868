//! The bench's HTTP side: one blocking connection per request (like independent clients),
//! streaming SSE read line by line, and `/metrics` scrapes.

use super::report::Outcome;
use super::Job;
use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

/// Where to send requests.
#[derive(Debug, Clone)]
pub struct Target {
    addr: SocketAddr,
    host: String,
    api_key: Option<String>,
}

impl Target {
    /// The base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.host)
    }

    pub fn parse(url: &str, api_key: Option<String>) -> Result<Self> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("--url must start with http:// (got {url:?})");
        };
        let host = rest.trim_end_matches('/').to_owned();
        let addr = host
            .to_socket_addrs()
            .with_context(|| format!("resolving {host}"))?
            .next()
            .with_context(|| format!("{host} has no address"))?;
        Ok(Target {
            addr,
            host,
            api_key,
        })
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<BufReader<TcpStream>> {
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(10))
            .with_context(|| format!("connecting to {}", self.host))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(600)))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            self.host,
            body.len()
        );
        if let Some(k) = &self.api_key {
            head.push_str(&format!("authorization: Bearer {k}\r\n"));
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        Ok(BufReader::new(s))
    }
}

fn status_line(r: &mut BufReader<TcpStream>) -> Result<u16> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
            return Ok(status);
        }
    }
}

/// Sends one streaming completion and times its tokens. Without `format` it generates
/// `max_tokens` whatever the model says; with one, it ends where the format does.
pub fn stream_completion(
    t: &Target,
    model: &str,
    job: &Job,
    scope: Option<&str>,
    format: Option<&serde_json::Value>,
) -> Outcome {
    let headers: Vec<(&str, &str)> = scope.map(|s| ("x-kvgate-scope", s)).into_iter().collect();
    stream_completion_with(t, model, job, &headers, format)
}

/// [`stream_completion`] with these extra request headers.
pub fn stream_completion_with(
    t: &Target,
    model: &str,
    job: &Job,
    headers: &[(&str, &str)],
    format: Option<&serde_json::Value>,
) -> Outcome {
    let start = Instant::now();
    let mut body = serde_json::json!({
        "model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
    });
    if let Some(f) = format {
        body["response_format"] = f.clone();
        body["ignore_eos"] = false.into();
    }
    let body = body.to_string();
    let mut out = Outcome::default();
    let result = (|| -> Result<()> {
        let mut r = t.send("POST", "/v1/completions", headers, &body)?;
        let status = status_line(&mut r)?;
        let mut line = String::new();
        let mut last = None;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                break;
            }
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if status != 200 || data.contains("\"error\"") {
                bail!("HTTP {status}: {data}");
            }
            if data == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            let usage = v.get("usage").filter(|u| !u.is_null());
            if let Some(u) = usage {
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
            // A token is a chunk with a choice; some servers (llama-server) also put an empty
            // choice in the final usage chunk, which is not one.
            let choice = v["choices"].get(0);
            let empty_final = usage.is_some() && choice.is_some_and(|c| c["text"] == "");
            if choice.is_some() && !empty_final {
                let now = Instant::now();
                match last {
                    None => out.ttft = Some(now - start),
                    Some(prev) => out.itl.push(now - prev),
                }
                last = Some(now);
            }
        }
        if status != 200 {
            bail!("HTTP {status}");
        }
        Ok(())
    })();
    out.latency = start.elapsed();
    if let Err(e) = result {
        out.error = Some(format!("{e:#}"));
    }
    out
}

/// Counter values from `/metrics` (summed over labels).
pub fn scrape(t: &Target) -> Result<HashMap<String, f64>> {
    let mut r = t.send("GET", "/metrics", &[], "")?;
    let status = status_line(&mut r)?;
    let mut text = String::new();
    r.read_to_string(&mut text)?;
    let mut out = HashMap::new();
    if status != 200 {
        return Ok(out); // a server without metrics: the report says so
    }
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = match l.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let key = name.split('{').next().unwrap_or(name).to_owned();
        let mode = name.contains("mode=\"swap\"");
        if let Ok(v) = value.parse::<f64>() {
            *out.entry(key.clone()).or_default() += v;
            if mode {
                *out.entry(format!("{key}:swap")).or_default() += v;
            }
        }
    }
    Ok(out)
}

/// Arrival times (seconds) of `n` requests at `rate` per second.
pub fn poisson(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.gen_range(f64::EPSILON..1.0);
            t += -u.ln() / rate;
            t
        })
        .collect()
}

/// (prompt text, approximate answer tokens) of the first `n` ShareGPT conversations that pass
/// vLLM's filter; prompts cut to `max_chars`.
pub fn sharegpt_prompts(path: &Path, n: usize, max_chars: usize) -> Result<Vec<(String, usize)>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut pos = bytes
        .iter()
        .position(|b| *b == b'[')
        .context("not a JSON array")?
        + 1;
    let mut out = Vec::new();
    while out.len() < n && pos < bytes.len() {
        while pos < bytes.len() && (bytes[pos].is_ascii_whitespace() || bytes[pos] == b',') {
            pos += 1;
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<serde_json::Value>();
        let Some(Ok(conv)) = stream.next() else { break };
        pos += stream.byte_offset();
        let turns = conv["conversations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let (Some(q), Some(a)) = (turns.first(), turns.get(1)) else {
            continue;
        };
        if q["from"] != "human" || a["from"] != "gpt" {
            continue;
        }
        let (q, a) = (
            q["value"].as_str().unwrap_or(""),
            a["value"].as_str().unwrap_or(""),
        );
        let (pt, at) = (
            kvgate_sim::memory::approx_tokens::approx_token_count(q),
            kvgate_sim::memory::approx_tokens::approx_token_count(a),
        );
        if pt < 4 || at < 4 || pt > 1024 || pt + at > 2048 {
            continue;
        }
        let cut: String = q.chars().take(max_chars).collect();
        out.push((cut, at));
    }
    if out.is_empty() {
        bail!("{}: no usable conversations", path.display());
    }
    Ok(out)
}
