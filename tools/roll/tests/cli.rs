//! What a caller of `presence-roll` sees when it is started wrongly: a clear
//! error naming what is wrong, exit code 2, and no cluster started. (Building
//! this test also builds the binary, which `.ci/run`'s roll then uses.)

use std::process::{Command, Output};

fn roll(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_presence-roll")).args(args).output().expect("presence-roll starts")
}

#[test]
fn a_binary_that_is_not_there_is_named_and_nothing_starts() {
    let dir = std::env::temp_dir().join(format!("presence-roll-cli-{}", std::process::id()));
    let output = roll(&["--binary", "/nonexistent/presenced", "--dir", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("no presenced at /nonexistent/presenced"), "stderr: {stderr}");
    assert!(!dir.exists(), "no node directory is made before the binaries are found");
}

#[test]
fn an_unknown_flag_is_named() {
    let output = roll(&["--sesions", "10"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("--sesions"), "stderr: {stderr}");
}

#[test]
fn a_count_that_is_not_a_number_is_named() {
    let output = roll(&["--sessions", "many"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("--sessions") && stderr.contains("many"), "stderr: {stderr}");
}
