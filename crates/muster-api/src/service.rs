//! Service specs (`kind: service`): a job template's fields plus what the
//! service controller reads (replicas, port, checks, update strategy,
//! spread, restart backoff, drain), parsed into
//! [`muster_model::ServiceSpec`] with every problem reported at once.
//!
//! ```yaml
//! kind: service
//! name: llm
//! replicas: 3
//! gpus: 1
//! command: [python3, -m, http.server]   # serves on $PORT
//! readiness: {http: /healthz, period: 2s}
//! update: {max_surge: 1, max_unavailable: 0}
//! ```

use crate::error::{SpecError, SpecErrors};
use crate::quantity::parse_duration;
use crate::wire::Quantity;
use muster_model as model;
use serde_json::{Map, Value};
use std::time::Duration;

/// The fields a service spec adds to a job spec's.
pub const SERVICE_FIELDS: &[&str] = &[
    "kind",
    "replicas",
    "port",
    "readiness",
    "liveness",
    "update",
    "spread",
    "restart",
    "drain",
    "autoscale",
    "auth",
];
const AUTH_FIELDS: &[&str] = &["bearer_secret"];
const AUTOSCALE_FIELDS: &[&str] = &[
    "min_replicas",
    "max_replicas",
    "requests_per_second",
    "in_flight",
    "gpu_utilization",
    "window",
];
const PROBE_FIELDS: &[&str] = &[
    "http",
    "tcp",
    "command",
    "period",
    "timeout",
    "failure_threshold",
    "success_threshold",
    "initial_delay",
];
const UPDATE_FIELDS: &[&str] = &["max_surge", "max_unavailable", "progress_deadline"];
const RESTART_FIELDS: &[&str] = &["initial", "max"];
/// Job fields that make no sense for a replica.
const JOB_ONLY_FIELDS: &[(&str, &str)] = &[
    (
        "nodes",
        "a replica is one task; ask for more replicas instead",
    ),
    ("array", "replicas are counted by `replicas`"),
    ("after", "a service starts when it is created"),
    (
        "max_runtime",
        "a replica runs until the service stops it; a time limit would stop every replica \
         at once",
    ),
    ("idle_timeout", "a service is reclaimed by scaling it down"),
    ("service", "set by muster on a service's replicas"),
];

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most
/// [`model::MAX_SERVICE_NAME_LENGTH`] characters: a DNS label, so it can be
/// a host name's first part at the gateway.
pub fn is_service_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let edge = |byte: &u8| byte.is_ascii_lowercase() || byte.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= model::MAX_SERVICE_NAME_LENGTH
        && bytes.first().is_some_and(edge)
        && bytes.last().is_some_and(edge)
        && bytes.iter().all(|byte| edge(byte) || *byte == b'-')
}

/// Parses and validates a service spec written in YAML.
pub fn parse_service_spec_yaml(text: &str) -> Result<model::ServiceSpec, SpecErrors> {
    crate::parse::check_size(text)?;
    let value = crate::parse::yaml_value(text)?;
    parse_service_spec_value(&value)
}

/// Reads and validates a service spec from a parsed YAML or JSON value.
pub fn parse_service_spec_value(value: &Value) -> Result<model::ServiceSpec, SpecErrors> {
    parse_value(value, false)
}

/// Reads a service spec the server stored when it accepted it: a limit
/// added since (a probe's timeout, an autoscaling window) is applied, not
/// refused, so that a service accepted before it is still run.
pub fn parse_stored_service_spec_value(value: &Value) -> Result<model::ServiceSpec, SpecErrors> {
    parse_value(value, true)
}

fn parse_value(value: &Value, stored: bool) -> Result<model::ServiceSpec, SpecErrors> {
    let Value::Object(map) = value else {
        return Err(SpecErrors::single(SpecError::document(
            "a service spec is a mapping of fields (kind: service, name: ..., replicas: ...)",
            None,
        )));
    };
    let mut errors = Vec::new();
    match map.get("kind") {
        Some(Value::String(kind)) if kind == "service" => {}
        Some(other) => errors.push(SpecError::new(
            "kind",
            format!("expected \"service\", got {other}"),
        )),
        None => errors.push(SpecError::new(
            "kind",
            "required: \"service\" (a job is submitted with `muster submit`)",
        )),
    }
    let mut job = Map::new();
    for (key, field) in map {
        if SERVICE_FIELDS.contains(&key.as_str()) {
            continue;
        }
        if let Some((_, why)) = JOB_ONLY_FIELDS.iter().find(|(name, _)| name == key) {
            errors.push(SpecError::new(
                key.clone(),
                format!("not a service field: {why}"),
            ));
            continue;
        }
        job.insert(key.clone(), field.clone());
    }
    let mut reader = Reader { errors, stored };
    let template = match crate::parse::parse_job_spec_value(&Value::Object(job)) {
        // Serving is not preempted by training unless the spec says so,
        // and outranks it.
        Ok(mut template) => {
            if !map.contains_key("preemptible") {
                template.preemptible = false;
            }
            if !map.contains_key("priority_class")
                && let Some(high) = model::PriorityClass::by_name("high")
            {
                template.priority_class = high;
            }
            Some(template)
        }
        Err(SpecErrors(job_errors)) => {
            reader.errors.extend(job_errors);
            None
        }
    };
    let replicas = match map.get("replicas") {
        None => 1,
        Some(value) => reader
            .whole(value, "replicas", 0, model::MAX_REPLICAS)
            .unwrap_or(1),
    };
    let port = map
        .get("port")
        .and_then(|value| reader.whole(value, "port", 1, 65_535))
        .map(|port| port as u16);
    let readiness = map
        .get("readiness")
        .and_then(|value| reader.probe(value, "readiness"));
    let liveness = map
        .get("liveness")
        .and_then(|value| reader.probe(value, "liveness"));
    let mut update = model::UpdateStrategy::default();
    if let Some(section) = map
        .get("update")
        .and_then(|value| reader.section(value, "update", UPDATE_FIELDS))
    {
        if let Some(value) = section.get("max_surge") {
            update.max_surge = reader
                .whole(value, "update.max_surge", 0, model::MAX_REPLICAS)
                .unwrap_or(update.max_surge);
        }
        if let Some(value) = section.get("max_unavailable") {
            update.max_unavailable = reader
                .whole(value, "update.max_unavailable", 0, model::MAX_REPLICAS)
                .unwrap_or(update.max_unavailable);
        }
        if let Some(value) = section.get("progress_deadline") {
            match reader.duration(value, "update.progress_deadline") {
                Some(Duration::ZERO) => {
                    reader.fail("update.progress_deadline", "must be at least 1s")
                }
                Some(deadline) => update.progress_deadline = Some(deadline),
                None => {}
            }
        }
        if update.max_surge == 0 && update.max_unavailable == 0 {
            reader.fail(
                "update",
                "max_surge and max_unavailable cannot both be 0: the update could never \
                 replace a replica (the default is max_surge: 1, max_unavailable: 0)",
            );
        }
    }
    let spread = match map.get("spread") {
        None => model::Spread::Nodes,
        Some(Value::String(text)) if text == "nodes" || text == "node" => model::Spread::Nodes,
        Some(Value::String(text)) if text == "racks" || text == "rack" => model::Spread::Racks,
        Some(other) => {
            reader.fail(
                "spread",
                format!("expected \"nodes\" (the default) or \"racks\", got {other}"),
            );
            model::Spread::Nodes
        }
    };
    let mut restart = model::RestartBackoff::default();
    if let Some(section) = map
        .get("restart")
        .and_then(|value| reader.section(value, "restart", RESTART_FIELDS))
    {
        if let Some(value) = section.get("initial") {
            restart.initial = reader
                .duration(value, "restart.initial")
                .unwrap_or(restart.initial);
        }
        if let Some(value) = section.get("max") {
            restart.max = reader.duration(value, "restart.max").unwrap_or(restart.max);
        }
        if restart.max < restart.initial {
            reader.fail(
                "restart.max",
                format!(
                    "must be at least restart.initial ({}s), got {}s",
                    restart.initial.as_secs(),
                    restart.max.as_secs()
                ),
            );
        }
    }
    let drain = match map.get("drain") {
        None => Duration::from_secs(2),
        Some(value) => reader
            .duration(value, "drain")
            .unwrap_or(Duration::from_secs(2)),
    };
    let autoscale = map
        .get("autoscale")
        .and_then(|value| reader.autoscale(value));
    let bearer_secret = map
        .get("auth")
        .and_then(|value| reader.section(value, "auth", AUTH_FIELDS))
        .and_then(|auth| match auth.get("bearer_secret") {
            // A secret's name as a job's `env: {X: {secret: NAME}}` takes.
            Some(Value::String(name)) if model::is_plain_name(name) && name.len() <= 63 => {
                Some(name.clone())
            }
            Some(other) => {
                reader.fail(
                    "auth.bearer_secret",
                    format!(
                        "expected the name of a secret (`muster secrets set NAME`: 1 to 63 \
                         letters, digits, '-', '_' or '.') whose value callers send as \
                         `Authorization: Bearer VALUE`, got {other}"
                    ),
                );
                None
            }
            None => {
                reader.fail(
                    "auth.bearer_secret",
                    "auth needs bearer_secret: the name of the secret callers present",
                );
                None
            }
        });
    if let Some(template) = &template
        && !is_service_name(&template.name)
    {
        reader.fail(
            "name",
            format!(
                "a service's name is a DNS label (lowercase letters, digits and '-', at most {} \
                 characters): it names the service at the gateway; got {:?}",
                model::MAX_SERVICE_NAME_LENGTH,
                template.name
            ),
        );
    }
    match template {
        Some(template) if reader.errors.is_empty() => Ok(model::ServiceSpec {
            name: template.name.clone(),
            replicas,
            template,
            port,
            readiness,
            liveness,
            update,
            spread,
            restart,
            drain,
            autoscale,
            bearer_secret,
        }),
        _ => Err(SpecErrors(reader.errors)),
    }
}

struct Reader {
    errors: Vec<SpecError>,
    /// Reading a stored spec: see [`parse_stored_service_spec_value`].
    stored: bool,
}

impl Reader {
    fn fail(&mut self, path: &str, message: impl Into<String>) {
        self.errors.push(SpecError::new(path, message));
    }

    /// `value`, if at most `max`; past it, an error (or `max`, for a stored
    /// spec).
    fn at_most(&mut self, path: &str, value: Duration, max: Duration) -> Option<Duration> {
        if value <= max || self.stored {
            return Some(value.min(max));
        }
        self.fail(
            path,
            format!(
                "must be at most {}s, got {}s",
                max.as_secs(),
                value.as_secs()
            ),
        );
        None
    }

    fn whole(&mut self, value: &Value, path: &str, minimum: u32, maximum: u32) -> Option<u32> {
        let number = match value {
            Value::Number(number) => number.as_u64(),
            Value::String(text) => text.trim().parse::<u64>().ok(),
            _ => None,
        };
        match number {
            Some(number) if number >= u64::from(minimum) && number <= u64::from(maximum) => {
                Some(number as u32)
            }
            _ => {
                self.fail(
                    path,
                    format!("expected a whole number from {minimum} to {maximum}, got {value}"),
                );
                None
            }
        }
    }

    fn duration(&mut self, value: &Value, path: &str) -> Option<Duration> {
        let quantity = match value {
            Value::Number(number) => Quantity::Number(number.clone()),
            Value::String(text) => Quantity::Text(text.clone()),
            other => {
                self.fail(
                    path,
                    format!("expected a duration like \"2s\" or \"1m\", got {other}"),
                );
                return None;
            }
        };
        match parse_duration(&quantity) {
            Ok(duration) => Some(duration),
            Err(reason) => {
                self.fail(path, format!("{reason}, got {value}"));
                None
            }
        }
    }

    fn section<'a>(
        &mut self,
        value: &'a Value,
        path: &str,
        accepted: &[&str],
    ) -> Option<&'a Map<String, Value>> {
        let Value::Object(section) = value else {
            self.fail(
                path,
                format!(
                    "expected a mapping with {}, got {value}",
                    accepted.join(", ")
                ),
            );
            return None;
        };
        for key in section.keys() {
            if !accepted.contains(&key.as_str()) {
                self.fail(
                    &format!("{path}.{key}"),
                    format!("unknown field; {path} takes {}", accepted.join(", ")),
                );
            }
        }
        Some(section)
    }

    fn positive(&mut self, value: &Value, path: &str, maximum: f64) -> Option<f64> {
        match value.as_f64() {
            Some(number) if number > 0.0 && number <= maximum => Some(number),
            _ => {
                self.fail(
                    path,
                    format!("expected a number above 0 and at most {maximum}, got {value}"),
                );
                None
            }
        }
    }

    fn autoscale(&mut self, value: &Value) -> Option<model::Autoscale> {
        let section = self.section(value, "autoscale", AUTOSCALE_FIELDS)?;
        let bound = |reader: &mut Reader, name: &str| {
            let path = format!("autoscale.{name}");
            match section.get(name) {
                Some(value) => reader.whole(value, &path, 0, model::MAX_REPLICAS),
                None => {
                    reader.fail(&path, "required: a whole number of replicas");
                    None
                }
            }
        };
        let min_replicas = bound(self, "min_replicas");
        let max_replicas = bound(self, "max_replicas");
        let mut metrics = Vec::new();
        if let Some(value) = section.get("requests_per_second") {
            metrics.push(
                self.positive(value, "autoscale.requests_per_second", 1e9)
                    .map(model::ScaleMetric::RequestRate),
            );
        }
        if let Some(value) = section.get("in_flight") {
            metrics.push(
                self.positive(value, "autoscale.in_flight", 1e9)
                    .map(model::ScaleMetric::InFlight),
            );
        }
        if let Some(value) = section.get("gpu_utilization") {
            metrics.push(
                self.positive(value, "autoscale.gpu_utilization", 100.0)
                    .map(model::ScaleMetric::GpuUtilization),
            );
        }
        if metrics.len() != 1 {
            self.fail(
                "autoscale",
                "say what to follow, once: `requests_per_second: N` or `in_flight: N` (per \
                 replica, at the gateways) or `gpu_utilization: PCT` (of the replicas' GPUs)",
            );
            return None;
        }
        let metric = metrics.pop().flatten()?;
        let window = match section.get("window") {
            Some(value) => self.duration(value, "autoscale.window")?,
            None => Duration::from_secs(60),
        };
        let window = self.at_most("autoscale.window", window, model::MAX_AUTOSCALE_WINDOW)?;
        let (min_replicas, max_replicas) = (min_replicas?, max_replicas?);
        if max_replicas == 0 || max_replicas < min_replicas {
            self.fail(
                "autoscale.max_replicas",
                format!(
                    "must be at least 1 and at least min_replicas ({min_replicas}), got \
                     {max_replicas}"
                ),
            );
            return None;
        }
        Some(model::Autoscale {
            min_replicas,
            max_replicas,
            metric,
            window,
        })
    }

    fn probe(&mut self, value: &Value, path: &str) -> Option<model::Probe> {
        let section = self.section(value, path, PROBE_FIELDS)?;
        let given: Vec<&str> = ["http", "tcp", "command"]
            .into_iter()
            .filter(|kind| section.contains_key(*kind))
            .collect();
        if given.len() != 1 {
            self.fail(
                path,
                if given.is_empty() {
                    "say what to check: `http: /healthz` (a GET answered 2xx or 3xx), `tcp: true` \
                     (the port accepts connections) or `command: [ARGS]` (exits 0, run beside \
                     the replica)"
                        .to_string()
                } else {
                    format!(
                        "one check: http, tcp or command, not {}",
                        given.join(" and ")
                    )
                },
            );
            return None;
        }
        let action = match (
            section.get("http"),
            section.get("tcp"),
            section.get("command"),
        ) {
            (Some(Value::String(http)), _, _) if http.starts_with('/') && http.len() <= 1024 => {
                if http.chars().any(|c| c.is_control() || c == ' ') {
                    self.fail(
                        &format!("{path}.http"),
                        "a path without spaces or control characters",
                    );
                    return None;
                }
                model::ProbeAction::Http { path: http.clone() }
            }
            (Some(other), _, _) => {
                self.fail(
                    &format!("{path}.http"),
                    format!("expected a path like \"/healthz\" (at most 1 KiB), got {other}"),
                );
                return None;
            }
            (_, Some(Value::Bool(true)), _) => model::ProbeAction::Tcp,
            (_, Some(other), _) => {
                self.fail(
                    &format!("{path}.tcp"),
                    format!("expected true (a TCP connection to the port), got {other}"),
                );
                return None;
            }
            (_, _, Some(Value::Array(items)))
                if !items.is_empty()
                    && items.len() <= 64
                    && items.iter().all(|item| {
                        item.as_str()
                            .is_some_and(|arg| arg.len() <= 4096 && !arg.contains('\0'))
                    }) =>
            {
                model::ProbeAction::Command(
                    items
                        .iter()
                        .filter_map(|item| item.as_str().map(str::to_string))
                        .collect(),
                )
            }
            (_, _, Some(other)) => {
                self.fail(
                    &format!("{path}.command"),
                    format!(
                        "expected a list of 1 to 64 texts (the program and its arguments), got \
                         {other}"
                    ),
                );
                return None;
            }
            (None, None, None) => return None,
        };
        let mut probe = model::Probe::new(action);
        let field = |name: &str| format!("{path}.{name}");
        if let Some(value) = section.get("period") {
            match self.duration(value, &field("period")) {
                Some(Duration::ZERO) => self.fail(&field("period"), "must be at least 1s"),
                Some(period) => probe.period = period,
                None => {}
            }
        }
        if let Some(value) = section.get("timeout") {
            match self.duration(value, &field("timeout")) {
                Some(Duration::ZERO) => self.fail(&field("timeout"), "must be at least 1s"),
                Some(timeout) => {
                    if let Some(timeout) =
                        self.at_most(&field("timeout"), timeout, model::MAX_PROBE_TIMEOUT)
                    {
                        probe.timeout = timeout;
                    }
                }
                None => {}
            }
        }
        if let Some(value) = section.get("initial_delay")
            && let Some(delay) = self.duration(value, &field("initial_delay"))
        {
            probe.initial_delay = delay;
        }
        if let Some(value) = section.get("failure_threshold")
            && let Some(threshold) = self.whole(value, &field("failure_threshold"), 1, 100)
        {
            probe.failure_threshold = threshold;
        }
        if let Some(value) = section.get("success_threshold")
            && let Some(threshold) = self.whole(value, &field("success_threshold"), 1, 100)
        {
            probe.success_threshold = threshold;
        }
        Some(probe)
    }
}

/// Writes a validated service spec back as a value that parses into the
/// same spec (what the server stores for each revision).
pub fn service_spec_value(spec: &model::ServiceSpec) -> Value {
    let mut template = spec.template.clone();
    template.service = None;
    let mut value = serde_json::to_value(crate::wire::JobSpec::from(&template))
        .unwrap_or(Value::Object(Map::new()));
    let Value::Object(map) = &mut value else {
        return value;
    };
    // A replica is one task; the template's own values say so already.
    map.remove("nodes");
    map.insert("kind".into(), "service".into());
    map.insert("replicas".into(), spec.replicas.into());
    if let Some(port) = spec.port {
        map.insert("port".into(), port.into());
    }
    let probe_value = |probe: &model::Probe| {
        let mut out = Map::new();
        match &probe.action {
            model::ProbeAction::Http { path } => {
                out.insert("http".into(), path.clone().into());
            }
            model::ProbeAction::Tcp => {
                out.insert("tcp".into(), true.into());
            }
            model::ProbeAction::Command(argv) => {
                out.insert("command".into(), argv.clone().into());
            }
        }
        out.insert("period".into(), probe.period.as_secs().into());
        out.insert("timeout".into(), probe.timeout.as_secs().into());
        out.insert("failure_threshold".into(), probe.failure_threshold.into());
        out.insert("success_threshold".into(), probe.success_threshold.into());
        out.insert("initial_delay".into(), probe.initial_delay.as_secs().into());
        Value::Object(out)
    };
    if let Some(probe) = &spec.readiness {
        map.insert("readiness".into(), probe_value(probe));
    }
    if let Some(probe) = &spec.liveness {
        map.insert("liveness".into(), probe_value(probe));
    }
    let mut update = serde_json::json!({
        "max_surge": spec.update.max_surge,
        "max_unavailable": spec.update.max_unavailable,
    });
    if let Some(deadline) = spec.update.progress_deadline {
        update["progress_deadline"] = deadline.as_secs().into();
    }
    map.insert("update".into(), update);
    map.insert(
        "spread".into(),
        match spec.spread {
            model::Spread::Nodes => "nodes",
            model::Spread::Racks => "racks",
        }
        .into(),
    );
    map.insert(
        "restart".into(),
        serde_json::json!({
            "initial": spec.restart.initial.as_secs(),
            "max": spec.restart.max.as_secs(),
        }),
    );
    map.insert("drain".into(), spec.drain.as_secs().into());
    if let Some(autoscale) = &spec.autoscale {
        let mut out = serde_json::json!({
            "min_replicas": autoscale.min_replicas,
            "max_replicas": autoscale.max_replicas,
            "window": autoscale.window.as_secs(),
        });
        match autoscale.metric {
            model::ScaleMetric::RequestRate(rate) => out["requests_per_second"] = rate.into(),
            model::ScaleMetric::InFlight(count) => out["in_flight"] = count.into(),
            model::ScaleMetric::GpuUtilization(pct) => out["gpu_utilization"] = pct.into(),
        }
        map.insert("autoscale".into(), out);
    }
    if let Some(secret) = &spec.bearer_secret {
        map.insert(
            "auth".into(),
            serde_json::json!({ "bearer_secret": secret }),
        );
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "
kind: service
name: web
replicas: 3
command: [python3, -m, http.server]
cpus: 1
memory: 512MiB
readiness: {http: /healthz, period: 1s, failure_threshold: 2}
liveness: {command: [sh, -c, 'test -d /proc/self'], period: 5s}
update: {max_surge: 0, max_unavailable: 1, progress_deadline: 20s}
spread: racks
restart: {initial: 2s, max: 30s}
autoscale: {min_replicas: 0, max_replicas: 5, requests_per_second: 20, window: 30s}
";

    #[test]
    fn a_service_spec_reads_and_writes_back_the_same() {
        let spec = parse_service_spec_yaml(SPEC).expect("valid");
        assert_eq!(spec.name, "web");
        assert_eq!(spec.replicas, 3);
        assert_eq!(spec.template.nodes, 1);
        assert!(
            !spec.template.preemptible,
            "serving is not preempted by default"
        );
        assert_eq!(spec.template.priority_class.name, "high");
        assert_eq!(spec.template.command, ["python3", "-m", "http.server"]);
        let readiness = spec.readiness.clone().expect("readiness");
        assert_eq!(
            readiness.action,
            model::ProbeAction::Http {
                path: "/healthz".into()
            }
        );
        assert_eq!(readiness.period, Duration::from_secs(1));
        assert_eq!(readiness.failure_threshold, 2);
        assert_eq!(
            spec.liveness.as_ref().map(|probe| probe.action.clone()),
            Some(model::ProbeAction::Command(vec![
                "sh".into(),
                "-c".into(),
                "test -d /proc/self".into()
            ]))
        );
        assert_eq!(spec.update.max_unavailable, 1);
        assert_eq!(spec.update.progress_deadline, Some(Duration::from_secs(20)));
        assert_eq!(spec.spread, model::Spread::Racks);
        assert_eq!(spec.restart.initial, Duration::from_secs(2));
        assert_eq!(
            spec.autoscale,
            Some(model::Autoscale {
                min_replicas: 0,
                max_replicas: 5,
                metric: model::ScaleMetric::RequestRate(20.0),
                window: Duration::from_secs(30),
            })
        );
        let again = parse_service_spec_value(&service_spec_value(&spec)).expect("reads back");
        assert_eq!(again, spec);
    }

    #[test]
    fn every_problem_of_a_service_spec_is_reported() {
        let errors = parse_service_spec_yaml(
            "
kind: job
name: Web_1
replicas: -1
nodes: 2
command: [x]
readiness: {http: healthz}
update: {max_surge: 0, max_unavailable: 0, surge: 1}
spread: zones
autoscale: {min_replicas: 2, max_replicas: 1, in_flight: 3, gpu_utilization: 50}
",
        )
        .expect_err("invalid")
        .to_string();
        for expected in [
            "kind: expected \"service\"",
            "nodes: not a service field",
            "replicas: expected a whole number",
            "readiness.http: expected a path",
            "update.surge: unknown field",
            "update: max_surge and max_unavailable cannot both be 0",
            "spread: expected \"nodes\"",
            "autoscale: say what to follow, once",
            "name",
        ] {
            assert!(
                errors.contains(expected),
                "{expected:?} missing in:\n{errors}"
            );
        }
    }

    #[test]
    fn a_probe_timeout_and_an_autoscaling_window_are_bounded() {
        let errors = parse_service_spec_yaml(
            "
kind: service
name: web
command: [x]
readiness: {http: /healthz, timeout: 11s}
autoscale: {min_replicas: 0, max_replicas: 2, requests_per_second: 5, window: 2h}
",
        )
        .expect_err("invalid")
        .to_string();
        for expected in [
            "readiness.timeout: must be at most 10s, got 11s",
            "autoscale.window: must be at most 3600s, got 7200s",
        ] {
            assert!(
                errors.contains(expected),
                "{expected:?} missing in:\n{errors}"
            );
        }
        parse_service_spec_yaml(
            "
kind: service
name: web
command: [x]
readiness: {http: /healthz, timeout: 10s}
autoscale: {min_replicas: 0, max_replicas: 2, requests_per_second: 5, window: 1h}
",
        )
        .expect("at the limits");
        // A spec stored before the limits is read with them applied.
        let stored = parse_stored_service_spec_value(&serde_json::json!({
            "kind": "service",
            "name": "web",
            "command": ["x"],
            "readiness": {"http": "/healthz", "timeout": "11s"},
            "autoscale": {"min_replicas": 0, "max_replicas": 2,
                          "requests_per_second": 5, "window": "2h"},
        }))
        .expect("a stored spec past the limits is read");
        let readiness = stored.readiness.expect("readiness");
        assert_eq!(readiness.timeout, model::MAX_PROBE_TIMEOUT);
        assert_eq!(
            stored.autoscale.expect("autoscale").window,
            model::MAX_AUTOSCALE_WINDOW
        );
    }

    #[test]
    fn a_bearer_secret_is_read_written_back_and_checked() {
        let spec = parse_service_spec_yaml(&format!("{SPEC}auth: {{bearer_secret: api-key}}\n"))
            .expect("valid");
        assert_eq!(spec.bearer_secret.as_deref(), Some("api-key"));
        let again = parse_service_spec_value(&service_spec_value(&spec)).expect("valid");
        assert_eq!(again, spec);
        for (bad, says) in [
            ("auth: {bearer_secret: 7}", "expected the name of a secret"),
            ("auth: {bearer_secret: ''}", "expected the name of a secret"),
            (
                "auth: {bearer_secret: 'a b'}",
                "expected the name of a secret",
            ),
            ("auth: {}", "auth needs bearer_secret"),
            ("auth: {token: x}", "unknown field"),
            ("auth: yes", "expected a mapping"),
        ] {
            let errors = parse_service_spec_yaml(&format!("{SPEC}{bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(errors.contains(says), "{bad}: {errors}");
        }
    }

    #[test]
    fn service_names_are_dns_labels() {
        assert!(is_service_name("llm-7b"));
        for bad in ["", "-a", "a-", "A", "a_b", &"a".repeat(64)] {
            assert!(!is_service_name(bad), "{bad:?}");
        }
    }
}
