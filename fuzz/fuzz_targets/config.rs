//! The configuration loader: a `--config` file's text and `BEDROCK_*` variables over the
//! built-in defaults, then validation.
//!
//! Promise: no panic; bad settings are a `ConfigError`; loaded settings print (the
//! `bedrock config` output) without the API key.

#![no_main]

use libfuzzer_sys::fuzz_target;
use secrecy::ExposeSecret as _;

fuzz_target!(|input: &[u8]| {
    let text = String::from_utf8_lossy(input);
    // The text up to the first NUL is the file; the lines after it are variables.
    let (file, vars) = text.split_once('\0').unwrap_or((&text, ""));
    let env: Vec<(String, String)> = vars
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (format!("BEDROCK_{k}"), v.to_owned()))
        .collect();
    if let Ok(settings) = bedrock::config::Settings::load_from_toml(file, env) {
        let printed = settings.masked_toml();
        let key = settings.llm.api_key.expose_secret();
        if key.len() >= 4 && key != "********" && !"********".contains(key) {
            assert!(
                !printed.contains(&format!("\"{key}\"")),
                "the API key is printed: {printed}"
            );
        }
    }
});
