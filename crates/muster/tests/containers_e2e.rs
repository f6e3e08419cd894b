//! A job with `image:` through a real server and agents: its tasks run as
//! containers of the machine's Docker engine (the test image made by
//! `muster_testkit::docker`), with the task contract, their output in
//! `muster logs`, their exit code as the job's, and a cancel that stops
//! and removes the container; and a 2-node gang of containers talks over
//! the host's network (rank 1 to rank 0 at MUSTER_MASTER_ADDR:PORT).
//! Without a Docker engine the tests say so and pass, unless
//! `MUSTER_REQUIRE_DOCKER` is set (as in CI).

use std::time::Duration;

mod common;

use common::cluster::{Cluster, runtime, state, wait_for_nodes, whole_log};
use common::wait_until;

fn containers_named(prefix: &str) -> String {
    let output = std::process::Command::new("docker")
        .args(["ps", "-a", "--format", "{{.Names}}", "--filter"])
        .arg(format!("name={prefix}"))
        .output()
        .expect("docker ps runs");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

#[test]
fn a_job_with_an_image_runs_in_a_container() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let _agent = cluster.agent_with("node-c", &url, "2xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let spec = serde_json::json!({
        "name": "boxed",
        "image": image,
        "gpus": 1,
        "working_dir": "/tmp",
        "env": {"GREETING": "hello"},
        "command": ["sh", "-c", "echo $GREETING from $(pwd) in $(hostname); env | sort; exit 4"],
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the job to end", Duration::from_secs(60), || {
        state(&rt, &client, id) == "failed"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    let text = whole_log(&rt, &client, id, 0);
    assert_eq!(job.exit_code, Some(4), "{job:?}\n{text}");
    assert!(text.contains("hello from /tmp"), "{text}");
    assert!(text.contains(&format!("MUSTER_JOB_ID={id}")), "{text}");
    assert!(text.contains("CUDA_VISIBLE_DEVICES=0"), "{text}");
    // The node's own PATH does not leak in.
    assert!(!text.contains("/root/.cargo"), "{text}");

    // A cancelled container job: stopped, and its container removed.
    let spec = serde_json::json!({
        "name": "boxed-long",
        "image": image,
        "command": ["sh", "-c", "echo started; while true; do sleep 1; done"],
    });
    let long = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the container to start", Duration::from_secs(60), || {
        rt.block_on(client.logs(long, 0, 0, None, false))
            .is_ok_and(|logs| String::from_utf8_lossy(&logs.data).contains("started"))
    });
    assert!(!containers_named(&format!("-j{long}-a")).is_empty());
    rt.block_on(client.cancel(long)).expect("cancelled");
    wait_until("the job to be cancelled", Duration::from_secs(60), || {
        state(&rt, &client, long) == "cancelled"
    });
    wait_until("its container to go", Duration::from_secs(30), || {
        containers_named(&format!("-j{long}-a")).is_empty()
    });
}

#[test]
fn a_two_node_container_gang_talks_over_the_host_network() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let _a = cluster.agent_with("node-a", &url, "1xH100-80GB", &[]);
    let _b = cluster.agent_with("node-b", &url, "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 2);
    // Rank 0 listens on the master port; rank 1 connects to it (retrying
    // while rank 0 starts) and sends a line, which rank 0 prints.
    let script = "if [ \"$MUSTER_NODE_RANK\" = 0 ]; then \
                    echo port=$MUSTER_MASTER_PORT; \
                    timeout 60 nc -l -p $MUSTER_MASTER_PORT; \
                  else \
                    for i in $(seq 1 100); do \
                      echo hello-from-rank-1 | nc $MUSTER_MASTER_ADDR $MUSTER_MASTER_PORT && exit 0; \
                      sleep 0.2; \
                    done; exit 1; \
                  fi";
    let spec = serde_json::json!({
        "name": "boxed-gang",
        "image": image,
        "nodes": 2,
        "gpus": 1,
        "command": ["sh", "-c", script],
    });
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the gang to finish", Duration::from_secs(90), || {
        let state = state(&rt, &client, id);
        state == "succeeded" || state == "failed"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    let text = whole_log(&rt, &client, id, 0);
    assert_eq!(job.state, "succeeded", "{job:?}\n{text}");
    assert!(
        text.contains("hello-from-rank-1"),
        "rank 0 heard rank 1: {text}"
    );
    // On the port of the cluster's range (`--master-port-base`) for the job.
    let port = cluster.master_port(id);
    assert!(text.contains(&format!("port={port}\n")), "{text}");
}

/// A registry on loopback that answers every request only after `delay`,
/// with 404 (it has no images): a pull that takes that long, then fails.
fn slow_registry(delay: Duration) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(&stream);
                let mut first = String::new();
                if reader.read_line(&mut first).is_err()
                    || !(first.starts_with("GET ") || first.starts_with("HEAD "))
                {
                    return;
                }
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                std::thread::sleep(delay);
                let mut stream = &stream;
                let _ = stream.write_all(
                    b"HTTP/1.1 404 Not Found\r\nDocker-Distribution-API-Version: registry/2.0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
            });
        }
    });
    port
}

/// While a task's image is being pulled, the job's task says so (the API's
/// `pulling`, shown by `muster describe`), and an image the registry does
/// not have fails the job with exit code 125 and the reason in its log.
#[test]
fn a_pull_shows_in_the_job_and_a_missing_image_fails_it() {
    if muster_testkit::docker::test_image().is_none() {
        return;
    }
    let port = slow_registry(Duration::from_secs(3));
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let _agent = cluster.agent_with("node-p", &url, "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    let image = format!("127.0.0.1:{port}/team/trainer:1");
    let spec = serde_json::json!({"name": "pulled", "image": image, "command": ["true"]});
    let id = rt.block_on(client.submit(spec)).expect("submitted");
    wait_until("the pull to show", Duration::from_secs(60), || {
        rt.block_on(client.job(id)).is_ok_and(|job| {
            job.tasks.first().is_some_and(|task| {
                task.state == "pulling"
                    && task
                        .pulling
                        .as_ref()
                        .is_some_and(|status| status.starts_with(&format!("pulling {image}")))
            })
        })
    });
    let described = common::muster(
        cluster.dir.path(),
        &[
            "describe",
            &id.to_string(),
            "--server",
            &url,
            "--token",
            &cluster.token("admin.token"),
            "--ca-sha256",
            &cluster.ca_sha256(),
        ],
    );
    let text = String::from_utf8_lossy(&described.stdout).into_owned();
    assert!(text.contains(&format!("pulling {image}")), "{text}");
    wait_until("the job to fail", Duration::from_secs(120), || {
        state(&rt, &client, id) == "failed"
    });
    let job = rt.block_on(client.job(id)).expect("job");
    assert_eq!(job.exit_code, Some(125), "{job:?}");
    assert!(
        job.tasks.iter().all(|task| task.pulling.is_none()),
        "{job:?}"
    );
    let text = whole_log(&rt, &client, id, 0);
    assert!(
        text.contains(&format!("cannot pull the image {image}")),
        "{text}"
    );
}

#[test]
fn a_service_in_an_image_is_checked_by_commands_inside_its_container() {
    let Some(image) = muster_testkit::docker::test_image() else {
        return;
    };
    let cluster = Cluster::start("10s");
    let url = cluster.url();
    let _agent = cluster.agent_with("node-s", &url, "1xH100-80GB", &[]);
    let rt = runtime();
    let client = cluster.client();
    wait_for_nodes(&rt, &client, 1);
    // Ready once /dev/shm/ready exists inside the container (its own /dev/shm;
    // the image's /tmp is not the task user's to write).
    let spec = |command: &str| {
        serde_json::json!({
            "kind": "service",
            "name": "boxed-web",
            "image": image,
            "replicas": 1,
            "command": ["sh", "-c", command],
            "readiness": {"command": ["sh", "-c", "test -f /dev/shm/ready"], "period": 1, "failure_threshold": 1},
            "update": {"progress_deadline": 4},
        })
    };
    let _ = std::fs::remove_file("/dev/shm/ready");
    rt.block_on(client.create_service(spec("sleep 1; echo > /dev/shm/ready; exec sleep 3600")))
        .expect("created");
    let mut last = None;
    let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(
            "the replica ready by a check in its container",
            Duration::from_secs(60),
            || {
                let view = rt.block_on(client.service("boxed-web")).ok();
                let ready = view.as_ref().is_some_and(|view| view.ready == 1);
                last = view;
                ready
            },
        )
    }));
    assert!(ready.is_ok(), "not ready: {last:#?}");
    assert!(
        !std::path::Path::new("/dev/shm/ready").exists(),
        "the file is the container's"
    );
    // A revision that never makes the file: its rollout stops, saying why.
    rt.block_on(client.update_service("boxed-web", spec("exec sleep 3600")))
        .expect("updated");
    wait_until("the rollout to stop", Duration::from_secs(60), || {
        rt.block_on(client.service("boxed-web"))
            .is_ok_and(|view| view.rollout.is_some_and(|why| why.contains("stopped")))
    });
    let view = rt
        .block_on(client.service("boxed-web"))
        .expect("the service");
    let why = view.rollout.unwrap_or_default();
    assert!(why.contains("test -f /dev/shm/ready` exited 1"), "{why}");
    assert_eq!(view.ready, 1);
    rt.block_on(client.delete_service("boxed-web"))
        .expect("deleted");
}
