//! Strict decoding of one opaque config object, plus the checks that need
//! nothing but the object itself.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::{Problem, ProblemKind};
use super::types::{
    Config, GpuConfig, GpuSharingStrategy, Kind, MigConfig, MigSharingStrategy, ProcessLimits,
    Quantity, ShareConfig,
};
use super::{API_GROUP, API_VERSION, MAX_PARAMETERS_BYTES};

/// Decodes raw `parameters` bytes (JSON, as stored in a RawExtension).
///
/// Never panics, whatever the input; see the fuzz target in `api/fuzz`.
pub fn decode(bytes: &[u8]) -> Result<Config, Problem> {
    if bytes.len() > MAX_PARAMETERS_BYTES {
        return Err(Problem::new(
            ProblemKind::Malformed,
            "parameters",
            format!("{} bytes is more than {MAX_PARAMETERS_BYTES}", bytes.len()),
            "keep the config small: only state the settings you change",
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        Problem::new(
            ProblemKind::Malformed,
            "parameters",
            format!("not valid JSON: {e}"),
            "write the parameters as a JSON/YAML object with apiVersion and kind",
        )
    })?;
    decode_value(&value)
}

/// Decodes an already parsed `parameters` object.
pub fn decode_value(value: &Value) -> Result<Config, Problem> {
    let Value::Object(object) = value else {
        return Err(Problem::new(
            ProblemKind::Malformed,
            "parameters",
            format!("expected an object, found {}", type_name(value)),
            format!("write an object with `apiVersion: {API_VERSION}` and a `kind`"),
        ));
    };
    let mut body = object.clone();
    let api_version = take_string(&mut body, "apiVersion")?;
    let kind_name = take_string(&mut body, "kind")?;
    check_api_version(&api_version)?;
    let kind = Kind::parse(&kind_name).ok_or_else(|| {
        Problem::new(
            ProblemKind::UnknownKind,
            "kind",
            format!("unknown kind `{kind_name}`"),
            format!("use one of {}", kinds_list()),
        )
    })?;
    let config = match kind {
        Kind::GpuConfig => Config::Gpu(body_as::<GpuConfig>(body, kind)?),
        Kind::MigConfig => Config::Mig(body_as::<MigConfig>(body, kind)?),
        Kind::ShareConfig => Config::Share(body_as::<ShareConfig>(body, kind)?),
    };
    validate(&config)?;
    Ok(config)
}

fn kinds_list() -> String {
    Kind::ALL.map(Kind::as_str).join(", ")
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn take_string(body: &mut Map<String, Value>, field: &str) -> Result<String, Problem> {
    match body.remove(field) {
        Some(Value::String(s)) => Ok(s),
        None => Err(Problem::new(
            ProblemKind::MissingField,
            field,
            "missing",
            match field {
                "apiVersion" => format!("add `apiVersion: {API_VERSION}`"),
                _ => format!("add `kind:` with one of {}", kinds_list()),
            },
        )),
        Some(other) => Err(Problem::new(
            ProblemKind::InvalidValue,
            field,
            format!("expected a string, found {}", type_name(&other)),
            "write it as a string",
        )),
    }
}

fn check_api_version(api_version: &str) -> Result<(), Problem> {
    if api_version == API_VERSION {
        return Ok(());
    }
    let (message, fix) = match api_version.split_once('/') {
        Some((group, version)) if group == API_GROUP => (
            format!("version `{version}` of {API_GROUP} is not served by this driver"),
            format!("use `{API_VERSION}`"),
        ),
        _ => (
            format!("`{api_version}` is not a Tessera config API version"),
            format!(
                "use `{API_VERSION}`; if this config is meant for another DRA driver, \
                 set its `opaque.driver` to that driver's name"
            ),
        ),
    };
    Err(Problem::new(
        ProblemKind::UnsupportedApiVersion,
        "apiVersion",
        message,
        fix,
    ))
}

fn body_as<T: DeserializeOwned>(body: Map<String, Value>, kind: Kind) -> Result<T, Problem> {
    serde_path_to_error::deserialize(Value::Object(body)).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        serde_problem(kind, path, message)
    })
}

/// Turns a serde error into a [`Problem`] with a fix users can act on.
fn serde_problem(kind: Kind, path: String, message: String) -> Problem {
    let field = if path == "." || path.is_empty() {
        "parameters".to_owned()
    } else {
        path
    };
    if let Some(rest) = message.strip_prefix("unknown field `") {
        // The path normally ends in the unknown key already; make sure it
        // does, so users see exactly where it is.
        let name = rest.split('`').next().unwrap_or_default();
        let expected = rest.split_once(", ").map(|x| x.1).unwrap_or("no fields");
        let field = if field == "parameters" {
            name.to_owned()
        } else if field == name || field.ends_with(&format!(".{name}")) {
            field
        } else {
            format!("{field}.{name}")
        };
        return Problem::new(
            ProblemKind::UnknownField,
            field,
            format!("not a field of {kind} ({expected})"),
            "remove it or correct its spelling (field names are case-sensitive)",
        );
    }
    let fix = if kind == Kind::MigConfig && field == "sharing.strategy" {
        "use None or MPS; MIG devices have no time-slicing setting because the time \
         slice belongs to the parent GPU, which is node policy"
            .to_owned()
    } else if message.starts_with("unknown variant") {
        "use one of the listed values (case-sensitive)".to_owned()
    } else if field.ends_with("memory") || field.ends_with("Memory") {
        "write a Kubernetes quantity such as 4Gi, 512Mi or 8G".to_owned()
    } else if field.ends_with("computePercent") {
        "write a whole number from 1 to 100".to_owned()
    } else {
        match field.as_str() {
            "sharing" => "write an object, e.g. `sharing: {strategy: MPS}`",
            "sharing.timeSlicing" => "write an object, e.g. `timeSlicing: {interval: Long}`",
            "sharing.mps" | "processLimits" => {
                "write an object, e.g. `{memory: 4Gi, computePercent: 50}`"
            }
            _ => "write the value in the form the message names",
        }
        .to_owned()
    };
    Problem::new(ProblemKind::InvalidValue, field, message, fix)
}

/// Checks that need only the config itself.
fn validate(config: &Config) -> Result<(), Problem> {
    match config {
        Config::Gpu(c) => {
            if let Some(sharing) = &c.sharing {
                let strategy = sharing.strategy;
                if sharing.time_slicing.is_some()
                    && strategy != Some(GpuSharingStrategy::TimeSlicing)
                {
                    return Err(block_without_strategy("timeSlicing", "TimeSlicing"));
                }
                if let Some(mps) = &sharing.mps {
                    if strategy != Some(GpuSharingStrategy::Mps) {
                        return Err(block_without_strategy("mps", "MPS"));
                    }
                    validate_limits(&mps.process_limits(), "sharing.mps")?;
                    validate_shared_memory(mps.shared_memory, "sharing.mps.sharedMemory")?;
                }
            }
        }
        Config::Mig(c) => {
            if let Some(sharing) = &c.sharing
                && let Some(mps) = &sharing.mps
            {
                if sharing.strategy != Some(MigSharingStrategy::Mps) {
                    return Err(block_without_strategy("mps", "MPS"));
                }
                validate_limits(&mps.process_limits(), "sharing.mps")?;
                validate_shared_memory(mps.shared_memory, "sharing.mps.sharedMemory")?;
            }
        }
        Config::Share(c) => {
            if let Some(limits) = &c.process_limits {
                validate_limits(limits, "processLimits")?;
            }
            validate_shared_memory(c.shared_memory, "sharedMemory")?;
        }
    }
    Ok(())
}

fn block_without_strategy(block: &str, strategy: &str) -> Problem {
    Problem::new(
        ProblemKind::InvalidValue,
        format!("sharing.{block}"),
        format!("set, but this config does not say `strategy: {strategy}`"),
        format!("add `strategy: {strategy}` next to it, or remove `{block}`"),
    )
}

fn validate_shared_memory(size: Option<Quantity>, at: &str) -> Result<(), Problem> {
    match size {
        Some(q) if q.bytes() < MIN_SHARED_MEMORY => Err(Problem::new(
            ProblemKind::InvalidValue,
            at,
            format!("{q} is less than 1Mi"),
            "give at least 1Mi (the MPS server needs some), or leave it out for the node's default",
        )),
        _ => Ok(()),
    }
}

/// The smallest `/dev/shm` a claim may ask for.
const MIN_SHARED_MEMORY: u64 = 1 << 20;

fn validate_limits(limits: &ProcessLimits, at: &str) -> Result<(), Problem> {
    if let Some(p) = limits.compute_percent
        && !(1..=100).contains(&p)
    {
        return Err(Problem::new(
            ProblemKind::InvalidValue,
            format!("{at}.computePercent"),
            format!("{p} is outside 1–100"),
            "use a percentage from 1 to 100",
        ));
    }
    if let Some(m) = limits.memory
        && m.bytes() == 0
    {
        return Err(Problem::new(
            ProblemKind::InvalidValue,
            format!("{at}.memory"),
            "zero bytes",
            "give a positive quantity such as 4Gi, or leave it out for no extra limit",
        ));
    }
    Ok(())
}
