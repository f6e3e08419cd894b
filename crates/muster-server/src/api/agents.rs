//! The agents' endpoints: registration (with its join token or node
//! credential), heartbeats (the node's lease, its tasks' reports and the
//! desired set, long-polled), telemetry and task logs.

use super::*;

/// The node spec a registration describes, validated as the control plane
/// will (every problem at once, each naming the field).
fn node_spec(request: &RegisterRequest) -> Result<NodeSpec, ApiError> {
    let address = request.address.trim();
    let mut problems = Vec::new();
    if address.is_empty() || address.len() > 253 || address.chars().any(char::is_control) {
        problems.push(
            "address must name where other nodes reach this one (a host name or IP address, at \
             most 253 characters)"
                .to_string(),
        );
    }
    if request.gpus.len() > muster_model::MAX_NODE_GPUS * 4 {
        // Not converted at all: the count is the problem.
        return Err(ApiError::invalid(format!(
            "the node lists {} GPUs; a node may have at most {}",
            request.gpus.len(),
            muster_model::MAX_NODE_GPUS
        )));
    }
    for (what, text) in [
        ("backend", Some(&request.backend)),
        ("driver_version", request.driver_version.as_ref()),
        ("cuda_version", request.cuda_version.as_ref()),
    ] {
        if text.is_some_and(|t| t.len() > 128 || t.chars().any(char::is_control)) {
            problems.push(format!("{what} must be at most 128 printable characters"));
        }
    }
    if request.stack.len() > 16 {
        problems.push(format!(
            "stack lists {} components; at most 16",
            request.stack.len()
        ));
    }
    for (component, version) in &request.stack {
        let plain = !component.is_empty()
            && component.len() <= 32
            && component
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !plain || matches!(component.as_str(), "driver" | "cuda") {
            problems.push(format!(
                "stack component {component:?}: a name of up to 32 lowercase letters, digits \
                 and '_' (driver and cuda have fields of their own)"
            ));
        }
        if version.len() > 128 || version.chars().any(char::is_control) {
            problems.push(format!(
                "stack.{component} must be at most 128 printable characters"
            ));
        }
    }
    let spec = NodeSpec {
        name: NodeName(request.name.clone()),
        pool: PoolName(
            request
                .pool
                .clone()
                .unwrap_or_else(|| "default".to_string()),
        ),
        rack: RackName(
            request
                .rack
                .clone()
                .unwrap_or_else(|| "default".to_string()),
        ),
        gpus: request
            .gpus
            .iter()
            .map(|gpu| GpuSpec {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: GpuModel::new(&gpu.model),
                memory: MemoryMib(gpu.memory_mib),
                nvlink_domain: gpu.nvlink_domain,
            })
            .collect(),
        cpu: CpuMilli(request.cpu_milli),
        memory: MemoryMib(request.memory_mib),
    };
    problems.extend(spec.problems());
    if problems.is_empty() {
        Ok(spec)
    } else {
        Err(ApiError::invalid(format!(
            "node {:?} cannot join:\n{}",
            request.name,
            problems.join("\n")
        )))
    }
}

/// Refuses a registration that claims more than a node may (see
/// `muster_control::node_claim_problems`).
fn claims_within(
    spec: &NodeSpec,
    address: &str,
    limits: crate::NodeLimits,
) -> Result<(), ApiError> {
    let problems = muster_control::node_claim_problems(spec, address, limits);
    if problems.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "node {} cannot join: {}",
        spec.name,
        problems.join("; ")
    )))
}

/// Register an agent's node: a new name with the join token, a known node
/// with its own credential. Returns the node's credential and the epoch
/// this registration opened.
#[utoipa::path(
    post, path = "/v1/agents/register", tag = "agents",
    request_body = RegisterRequest,
    responses(
        (status = 200, body = RegisterResponse),
        (status = 400, description = "a node spec the cluster cannot take, every problem named", body = ErrorBody),
        (status = 409, description = "the name belongs to a registered node: use its credential", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn register_agent(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    Body(mut request): Body<RegisterRequest>,
) -> Result<Json<RegisterResponse>, ApiError> {
    // A token made for a pool puts its nodes there.
    if let Identity::Join(id) = &identity
        && let Some(pool) = shared
            .join_tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .and_then(|record| record.pool.clone())
    {
        match &request.pool {
            Some(asked) if *asked != pool => {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    format!(
                        "the join token {id} admits nodes to pool {pool}, and this node asks for                          pool {asked}; start the agent with --pool {pool} or use another token"
                    ),
                ));
            }
            _ => request.pool = Some(pool),
        }
    }
    let spec = node_spec(&request)?;
    claims_within(&spec, &request.address, shared.settings.node_limits)?;
    let name = spec.name.clone();
    let uuids: Vec<String> = spec.gpus.iter().map(|gpu| gpu.uuid.clone()).collect();
    let input = Input::Register {
        spec,
        address: request.address.trim().to_string(),
        software: Software {
            backend: request.backend.clone(),
            driver: request.driver_version.clone(),
            cuda: request.cuda_version.clone(),
            stack: request.stack.clone(),
        },
    };
    let join_id = match &identity {
        Identity::Join(id) => Some(id.clone()),
        _ => None,
    };
    let tokens = &shared.join_tokens;
    let taken = std::sync::Mutex::new(None);
    let outcome = shared.apply_with_batch(
        |core: &mut Core| {
            // GPUs are one node's: a claim of another node's UUIDs is a
            // copy or a lie.
            if let Some((uuid, holder)) = core.control().gpu_held_elsewhere(&name, &uuids) {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "node {name} claims GPU {uuid}, which node {holder} holds; a GPU belongs \
                         to one node (remove the other with `muster nodes remove {holder}` if it \
                         is gone)"
                    ),
                ));
            }
            let token = match &identity {
                // The join token admits only names without an identity.
                Identity::Join(_) if core.has_credential(&name) => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "node {name} is already registered; its agent registers again with \
                             the node credential kept in its state directory (node.credential). \
                             If that is lost, an admin can run `muster nodes reset-identity \
                             {name}`, or pick another --name"
                        ),
                    ));
                }
                Identity::Join(id) => {
                    // A new node: one use of the token, its own credential
                    // from now on.
                    let record = tokens
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .take_use(id, now().0)
                        .map_err(|why| ApiError::new(ErrorCode::PermissionDenied, why))?;
                    *taken
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(record);
                    let fresh = new_token()
                        .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?;
                    core.set_credential(&name, fresh.clone());
                    fresh
                }
                Identity::Node(owner) if owner == &name.0 => {
                    core.credential(&name).unwrap_or_default()
                }
                Identity::Node(owner) => {
                    return Err(ApiError::new(
                        ErrorCode::PermissionDenied,
                        format!("this credential belongs to node {owner}, not to node {name}"),
                    ));
                }
                Identity::Admin | Identity::Metrics | Identity::User(_) => {
                    return Err(ApiError::new(
                        ErrorCode::PermissionDenied,
                        "agents register with the join token or their node credential, not a \
                         user's, the admin or the metrics token",
                    ));
                }
            };
            Ok((input, (token, name.clone())))
        },
        |core, (token, name)| {
            let epoch = core.control().node(&name).map_or(0, |node| node.epoch);
            (token, epoch)
        },
        |_| {
            let mut batch = Batch::default();
            if let Some(record) = taken
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_ref()
                && let Ok(json) = serde_json::to_string(record)
            {
                batch.join_tokens.insert(record.id.clone(), Some(json));
            }
            batch
        },
    );
    let give_back = || {
        if let Some(id) = &join_id
            && taken
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_some()
        {
            tokens
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .give_back(id);
        }
    };
    let (_, durable, (token, epoch)) = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            give_back();
            return Err(error);
        }
    };
    if let Err(error) = durable.wait().await {
        give_back();
        return Err(error.into());
    }
    tracing::info!(node = %request.name, epoch, "node registered");
    Ok(Json(RegisterResponse {
        node_token: token,
        epoch,
        lease_ms: shared.settings.lease_ms,
        heartbeat_ms: shared.settings.heartbeat_ms,
    }))
}

/// Renew the node's lease, report its allocations, and get what it must
/// run (long poll while `known_version` is current).
#[utoipa::path(
    post, path = "/v1/agents/{node}/heartbeat", tag = "agents",
    params(("node" = String, Path, description = "the node's name")),
    request_body = HeartbeatRequest,
    responses(
        (status = 200, body = HeartbeatResponse),
        (status = 404, description = "unknown node: register first", body = ErrorBody),
        (status = 409, description = "an old epoch: register again", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn heartbeat(
    State(shared): Shared_,
    PathParams(node): PathParams<String>,
    Body(request): Body<HeartbeatRequest>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    let name = NodeName(node);
    shared
        .lock()
        .note_heartbeat(&name, std::time::Instant::now());
    let observed = request
        .observed
        .iter()
        .map(|o| Observed {
            allocation: AllocationId(o.allocation),
            generation: o.generation,
            exited: o.exited,
            fenced: o.fenced,
            memory_limit: o.memory_limit,
        })
        .collect();
    // Its own changes become durable with the barrier below.
    let _ = shared.apply(
        Input::Heartbeat {
            node: name.clone(),
            epoch: request.epoch,
            sequence: request.sequence,
            observed,
            unhealthy: Some(request.unhealthy_gpus.clone()),
        },
        Batch::default(),
    )?;
    {
        let mut pulling = match shared.pulling.lock() {
            Ok(pulling) => pulling,
            Err(poisoned) => poisoned.into_inner(),
        };
        if request.pulling.is_empty() {
            pulling.remove(&name.0);
        } else {
            let statuses = request
                .pulling
                .iter()
                .take(64)
                .map(|pull| {
                    let mut status = pull.status.clone();
                    muster_model::truncate_at_char_boundary(&mut status, 512);
                    (pull.allocation, status)
                })
                .collect();
            pulling.insert(name.0.clone(), statuses);
        }
    }
    let mut versions = shared.lock().watch_desired(&name);
    let current = *versions.borrow_and_update();
    let wait = Duration::from_millis(request.wait_ms)
        .min(MAX_HEARTBEAT_WAIT)
        .min(Duration::from_millis(shared.settings.lease_ms / 2));
    if request.known_version == current && !wait.is_zero() {
        let mut shutdown = shared.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = versions.changed() => {}
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
    }
    let (version, desired, covered) = {
        let core = shared.read();
        let version = *versions.borrow();
        let mut desired = core
            .control()
            .desired(&name)
            .into_iter()
            .map(desired_view)
            .collect::<Vec<_>>();
        crate::secrets::fill(&shared, core.control(), &mut desired);
        crate::services::fill_checks(&shared, core.control(), &mut desired);
        crate::users::fill_groups(&shared, &mut desired);
        // Every change so far is queued at or before this number.
        (version, desired, shared.writer.queued())
    };
    // A barrier: every change made before the state was read is durable
    // before the agent may act on it (no task runs that a restarted server
    // would not know about). Fails once the store has failed.
    shared
        .writer
        .durable_through(covered)
        .await
        .map_err(|error| match shared.read_only_reason() {
            Some(reason) => shared.refused(&reason),
            None => ApiError::from(error),
        })?;
    // A renewal of the node's lease only from a server whose own lease is
    // current: one woken from a pause may have been replaced.
    if let Some(clock) = &shared.settings.leadership
        && let Err(since) = clock.current(std::time::Instant::now())
    {
        return Err(crate::core::no_longer_leads(&format!(
            "its lease was last renewed {} ms ago, more than a lease: it leads again only once \
             it renews",
            since.as_millis()
        )));
    }
    Ok(Json(HeartbeatResponse {
        version,
        lease_ms: shared.settings.lease_ms,
        desired,
        tunnels: crate::dev::to_open(&shared, &name.0),
    }))
}

/// A node's telemetry: kept (the latest per node, in memory) for `/metrics`.
#[utoipa::path(
    post, path = "/v1/agents/{node}/telemetry", tag = "agents",
    params(("node" = String, Path, description = "the node's name")),
    request_body = TelemetryReport,
    responses(
        (status = 200, description = "kept"),
        (status = 400, description = "more GPUs or interfaces than a node has", body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "the report is of an earlier registration (epoch)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn push_telemetry(
    State(shared): Shared_,
    PathParams(node): PathParams<String>,
    Body(report): Body<TelemetryReport>,
) -> Result<Json<serde_json::Value>, ApiError> {
    // A node's numbers go into every scrape: each must be a reading a
    // device could give (no NaN, no 250% utilisation, no negative power).
    let plausible = |value: Option<f64>, most: f64| {
        value.is_none_or(|v| v.is_finite() && (0.0..=most).contains(&v))
    };
    if report.gpus.iter().any(|gpu| {
        gpu.utilization_pct > 100
            || (gpu.memory_total_mib > 0 && gpu.memory_used_mib > gpu.memory_total_mib)
            || !plausible(gpu.power_watts, 100_000.0)
    }) || !plausible(report.node.cpu_busy_pct, 100.0)
    {
        return Err(ApiError::invalid(
            "a reading is out of range: utilisation 0 to 100%, power 0 to 100 kW, finite, \
             memory used at most the total",
        ));
    }
    if report.gpus.len() > muster_model::MAX_NODE_GPUS
        || report.node.network.len() > 64
        || report.node.network.iter().any(|i| i.interface.len() > 64)
    {
        return Err(ApiError::invalid(format!(
            "a report has at most {} GPUs and 64 interfaces of names up to 64 bytes",
            muster_model::MAX_NODE_GPUS
        )));
    }
    let mut idle = Vec::new();
    {
        let core = shared.read();
        let name = muster_model::NodeName::from(node.as_str());
        let Some(known) = core.control().node(&name) else {
            return Err(node_not_found(&node));
        };
        if known.epoch != report.epoch {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "the report is of epoch {}, the node's registration is epoch {}",
                    report.epoch, known.epoch
                ),
            ));
        }
        let mut usage = match shared.usage.lock() {
            Ok(usage) => usage,
            Err(poisoned) => poisoned.into_inner(),
        };
        let readings: Vec<muster_control::usage::GpuReading> = report
            .gpus
            .iter()
            .map(|gpu| muster_control::usage::GpuReading {
                index: gpu.index,
                utilization_pct: gpu.utilization_pct,
                memory_used_mib: gpu.memory_used_mib,
            })
            .collect();
        let samples = muster_control::usage::record_usage(
            usage.entry(node.clone()).or_default(),
            core.control(),
            &name,
            &readings,
            now().0,
        );
        shared.accounting.observe(&shared, core.control(), &samples);
        // Jobs on this node idle for their own idle_timeout are stopped.
        let control = core.control();
        let jobs: std::collections::BTreeSet<JobId> =
            control.live_allocations(&name).map(|a| a.job).collect();
        for id in jobs {
            let Some(job) = control.job(id) else {
                continue;
            };
            let Some(timeout) = control.idle_timeout_of(job) else {
                continue;
            };
            let threshold = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
            if muster_control::usage::idle_for_ms(control, &usage, job, now().0, threshold)
                .is_some()
            {
                idle.push(id);
            }
        }
    }
    for job in idle {
        tracing::info!(job = job.0, "stopping an idle job (its idle_timeout)");
        if let Err(error) = shared.apply(Input::StopIdle { job }, Batch::default()) {
            tracing::warn!(job = job.0, error = %error.body.message, "cannot stop an idle job");
        }
    }
    match shared.history.lock() {
        Ok(mut history) => history.record(&node, &report, now().0),
        Err(poisoned) => poisoned.into_inner().record(&node, &report, now().0),
    }
    let entry = crate::metrics::NodeTelemetry {
        received_ms: now().0,
        report,
    };
    match shared.telemetry.lock() {
        Ok(mut telemetry) => telemetry.insert(node, entry),
        Err(poisoned) => poisoned.into_inner().insert(node, entry),
    };
    Ok(Json(serde_json::json!({})))
}

/// Store an allocation's output at a byte offset of what the task wrote
/// (bytes already stored are skipped, so retries are harmless). An empty
/// chunk at offset 0 asks where the server's copy ends.
#[utoipa::path(
    post, path = "/v1/agents/{node}/logs", tag = "agents",
    params(("node" = String, Path, description = "the node's name")),
    request_body = LogChunk,
    responses(
        (status = 200, body = LogAck),
        (status = 400, description = "the chunk is too large or not base64", body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "the chunk starts past the end of the log; the message names the byte to send from", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn push_logs(
    State(shared): Shared_,
    PathParams(node): PathParams<String>,
    Body(chunk): Body<LogChunk>,
) -> Result<Json<LogAck>, ApiError> {
    let allocation = AllocationId(chunk.allocation);
    // The job's limit is shared by its tasks.
    let tasks = {
        let core = shared.read();
        let Some(found) = core.control().allocation(allocation) else {
            return Err(ApiError::not_found(format!(
                "no allocation {allocation}; send logs only for allocations this node was given"
            )));
        };
        if found.node.0 != node {
            return Err(ApiError::new(
                ErrorCode::PermissionDenied,
                format!(
                    "allocation {allocation} is on node {}, not {node}",
                    found.node
                ),
            ));
        }
        core.control()
            .job(found.job)
            .map_or(1, |job| job.spec.nodes)
    };
    if chunk.data.len() > MAX_LOG_CHUNK_BYTES {
        return Err(ApiError::invalid(format!(
            "the chunk has {} bytes; send at most {MAX_LOG_CHUNK_BYTES} per chunk",
            chunk.data.len()
        )));
    }
    let logs = Arc::clone(&shared.logs);
    let appended = tokio::task::spawn_blocking(move || {
        logs.append(
            chunk.allocation,
            tasks,
            chunk.offset,
            &chunk.data,
            chunk.omit_gap,
            chunk.eof,
        )
    })
    .await
    .map_err(|error| {
        ApiError::new(
            ErrorCode::Internal,
            format!("the log write failed: {error}"),
        )
    })?
    .map_err(|error| match error {
        crate::logstore::AppendError::Io { .. } => {
            ApiError::new(ErrorCode::Internal, error.to_string())
        }
        _ => ApiError::new(ErrorCode::Conflict, error.to_string()),
    })?;
    shared.changes.send_modify(|version| *version += 1);
    Ok(Json(LogAck {
        next_offset: appended.end,
        head_bytes: Some(appended.head_bytes),
        tail_bytes: Some(appended.tail_bytes),
    }))
}
