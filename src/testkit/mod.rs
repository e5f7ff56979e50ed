//! Test and benchmark support that ships with the library: a scripted OpenAI-compatible
//! server speaking the real streaming wire format. Nothing in the service uses it.

mod fake_llm;

pub use fake_llm::{FakeLlm, Reply};
