//! Every TOML file kvgate ships (`deploy/**/*.toml`: the compose stack's, Kubernetes' base and
//! overlays) goes through the real config parsers, which deny unknown fields and check each
//! value's type and range: a file that would not start an engine or a gateway fails here, and
//! the check cannot drift from the structs it checks. Secrets must come from the environment.

use kvgate_engine::server::config::{Device, EngineConfig};
use kvgate_gateway::GatewayConfig;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `*.toml` under `dir`, recursively.
fn toml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            toml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "toml") {
            out.push(path);
        }
    }
}

/// The file with its `${KVGATE_*}` placeholders filled as the image's entrypoint fills them.
fn filled(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${KVGATE_") {
        out.push_str(&rest[..start]);
        let end = start + rest[start..].find('}').expect("a closed placeholder");
        let name = &rest[start + 2..end];
        out.push_str(if name == "KVGATE_HASH_SEED" {
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
        } else {
            "a-secret-from-the-environment"
        });
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

#[test]
fn every_shipped_config_parses_with_the_real_parsers() {
    let mut files = Vec::new();
    toml_files(&root().join("deploy"), &mut files);
    files.sort();
    let (mut engines, mut gateways) = (0, 0);
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        let shown = path.strip_prefix(root()).unwrap_or(path).display();
        if name.starts_with("engine") {
            let mut config: EngineConfig =
                toml::from_str(&filled(&text)).unwrap_or_else(|e| panic!("{shown}: {e}"));
            // A GPU overlay names a CUDA device, which a build without CUDA refuses to open.
            if config.device != Device::Cpu && !cfg!(feature = "cuda") {
                config.device = Device::Cpu;
            }
            config.validate().unwrap_or_else(|e| panic!("{shown}: {e}"));
            for secret in [
                "KVGATE_ENGINE_TOKEN",
                "KVGATE_OPERATOR_TOKEN",
                "KVGATE_HASH_SEED",
            ] {
                assert!(
                    text.contains(&format!("${{{secret}}}")),
                    "{shown}: the engine's {secret} must come from the environment"
                );
            }
            engines += 1;
        } else if name.starts_with("gateway") {
            let config: GatewayConfig =
                toml::from_str(&filled(&text)).unwrap_or_else(|e| panic!("{shown}: {e}"));
            config.validate().unwrap_or_else(|e| panic!("{shown}: {e}"));
            for (field, set) in [
                ("operator_token", config.operator_token.is_some()),
                ("engine_token", config.engine_token.is_some()),
                ("pepper", config.pepper.is_some()),
                ("hash_seed", config.hash_seed.is_some()),
            ] {
                assert!(
                    !set,
                    "{shown}: {field} belongs in the environment (KVGATE_*), not the file"
                );
            }
            gateways += 1;
        } else {
            panic!("{shown}: neither an engine nor a gateway config");
        }
    }
    assert!(
        engines >= 3 && gateways >= 2,
        "{engines} engine and {gateways} gateway configs found"
    );
}
