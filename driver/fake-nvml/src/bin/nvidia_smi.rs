//! An `nvidia-smi` stand-in for containers on a simulated node.
//!
//! It loads `libnvidia-ml.so.1` through the dynamic loader and asks NVML,
//! as the real tool does, so inside a container it lists exactly what the
//! fake library shows there (see `TESSERA_FAKE_NVML_DEV_ROOT`). Only the
//! subset scripts use is supported, printed as the real tool prints it:
//!
//! - no arguments: the summary table, whose first row names the driver
//!   version and the CUDA version (see `summary.rs`)
//! - `-L` / `--list-gpus`
//! - `--query-gpu=<fields> --format=csv[,noheader][,nounits]` with fields
//!   `index`, `uuid`, `name`, `memory.total`, `pci.bus_id`, `mig.mode.current`
//! - `-i` / `--id` `<index|UUID|PCI bus id>[,...]` to select GPUs
//! - `compute-policy [-i <id>] --set-timeslice=<0|1|2|3>` (default, short,
//!   medium, long) and `compute-policy [-i <id>] -l` / `--list` to read it
//!   back; kept per GPU in the simulated machine's state file, so every
//!   process sees it, and refused where that state is read-only (a container)
//!
//! Exit codes are the real tool's: 2 bad arguments, 6 no devices found,
//! 9 driver not reachable (NVML init failed), 12 NVML library not loadable.
//! Anything else is refused with exit 2, never answered with a silent success.

use std::process::ExitCode;

#[path = "nvidia_smi/summary.rs"]
mod summary;

use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

const HELP_HINT: &str = "Please run 'nvidia-smi -h' for help.";
const NO_DEVICES: &str = "No devices were found";

/// What was asked for.
#[derive(Debug, Default)]
struct Args {
    list: bool,
    query: Option<String>,
    format: Option<String>,
    ids: Option<String>,
}

/// A failure with the real tool's message and exit code.
struct Exit(String, u8);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(Exit(msg, code)) => {
            // The real tool prints its errors on stdout too; usage errors
            // go to stderr here so scripts capturing stdout see nothing.
            if code == 2 {
                eprintln!("{msg}");
            } else {
                println!("{msg}");
            }
            ExitCode::from(code)
        }
    }
}

fn run(argv: &[String]) -> Result<String, Exit> {
    if argv.first().map(String::as_str) == Some("compute-policy") {
        return compute_policy(&argv[1..]);
    }
    let args = parse(argv)?;
    if argv.is_empty() {
        let nvml = init()?;
        let gpus = select(&nvml, None)?;
        return Ok(summary::render(&nvml, &gpus));
    }
    if args.list == args.query.is_some() {
        return Err(usage_error(
            "this nvidia-smi stand-in supports exactly one of -L and --query-gpu",
        ));
    }
    let fields = match &args.query {
        Some(q) => Some(Query::parse(q, args.format.as_deref())?),
        None if args.format.is_some() => return Err(invalid_combination()),
        None => None,
    };
    let nvml = init()?;
    let gpus = select(&nvml, args.ids.as_deref())?;
    Ok(match fields {
        Some(query) => query.render(&gpus),
        None => list(&gpus),
    })
}

fn usage_error(msg: &str) -> Exit {
    Exit(format!("ERROR: {msg}. {HELP_HINT}"), 2)
}

fn invalid_combination() -> Exit {
    Exit(
        format!("Invalid combination of input arguments. {HELP_HINT}"),
        2,
    )
}

/// Command-line words read as options: a value follows as the next word,
/// or after `=` in a `--long=value` word.
struct Options<'a> {
    words: std::slice::Iter<'a, String>,
}

struct Opt<'a> {
    word: &'a str,
    flag: &'a str,
    inline: Option<&'a str>,
}

impl<'a> Options<'a> {
    fn new(argv: &'a [String]) -> Self {
        Options { words: argv.iter() }
    }

    fn next_option(&mut self) -> Option<Opt<'a>> {
        let word = self.words.next()?;
        let (flag, inline) = match word.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v)),
            _ => (word.as_str(), None),
        };
        Some(Opt { word, flag, inline })
    }

    fn value(&mut self, opt: &Opt<'a>) -> Result<String, Exit> {
        opt.inline
            .map(str::to_owned)
            .or_else(|| self.words.next().cloned())
            .ok_or_else(|| usage_error(&format!("Option {} is missing its value", opt.flag)))
    }
}

fn unrecognized(opt: &Opt) -> Exit {
    usage_error(&format!("Option {} is not recognized", opt.word))
}

/// Reads the options of the GPU listing and query modes.
fn parse(argv: &[String]) -> Result<Args, Exit> {
    let mut args = Args::default();
    let mut options = Options::new(argv);
    while let Some(opt) = options.next_option() {
        match opt.flag {
            "-h" | "--help" => return Err(Exit(help(), 0)),
            "-L" | "--list-gpus" if opt.inline.is_none() => args.list = true,
            "--query-gpu" => args.query = Some(options.value(&opt)?),
            "--format" => args.format = Some(options.value(&opt)?),
            "-i" | "--id" => args.ids = Some(options.value(&opt)?),
            _ => return Err(unrecognized(&opt)),
        }
    }
    Ok(args)
}

fn help() -> String {
    "NVIDIA System Management Interface -- Tessera's simulated-GPU stand-in\n\n\
     nvidia-smi\n\
     nvidia-smi [-i <id>] -L\n\
     nvidia-smi [-i <id>] --query-gpu=<fields> --format=csv[,noheader][,nounits]\n\
     nvidia-smi compute-policy [-i <id>] --set-timeslice=<0|1|2|3>\n\
     nvidia-smi compute-policy [-i <id>] -l\n\n\
     Fields: index, uuid, name, memory.total, pci.bus_id, mig.mode.current\n\
     <id>: a GPU index, UUID or PCI bus id, or a comma-separated list of them"
        .to_string()
}

/// Loads NVML through the dynamic loader, as the real tool does.
fn init() -> Result<Nvml, Exit> {
    Nvml::init().map_err(|e| match e {
        NvmlError::LibloadingError(_) => Exit(
            "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure \
             that the NVIDIA Display Driver is properly installed and present in your system.\n\
             Please also try adding directory that contains libnvidia-ml.so to your system PATH."
                .to_string(),
            12,
        ),
        _ => Exit(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. \
             Make sure that the latest NVIDIA driver is installed and running."
                .to_string(),
            9,
        ),
    })
}

/// The GPUs asked for (all without `-i`), in the order given.
fn select<'n>(nvml: &'n Nvml, ids: Option<&str>) -> Result<Vec<Device<'n>>, Exit> {
    let not_found = || Exit(NO_DEVICES.to_string(), 6);
    let gpus: Vec<Device<'n>> = match ids {
        None => {
            let count = nvml.device_count().map_err(|_| not_found())?;
            (0..count)
                .map(|i| nvml.device_by_index(i))
                .collect::<Result<_, _>>()
                .map_err(|_| not_found())?
        }
        Some(ids) => ids
            .split(',')
            .map(|id| find(nvml, id.trim()).ok_or_else(not_found))
            .collect::<Result<_, _>>()?,
    };
    if gpus.is_empty() {
        return Err(not_found());
    }
    Ok(gpus)
}

/// One GPU by index, UUID or PCI bus id.
fn find<'n>(nvml: &'n Nvml, id: &str) -> Option<Device<'n>> {
    if let Ok(index) = id.parse::<u32>() {
        return nvml.device_by_index(index).ok();
    }
    if id.to_ascii_uppercase().starts_with("GPU-") {
        return nvml.device_by_uuid(id).ok();
    }
    nvml.device_by_pci_bus_id(id).ok()
}

/// `-L`: each GPU, then its MIG devices indented below it.
fn list(gpus: &[Device]) -> String {
    let mut out = String::new();
    for gpu in gpus {
        out += &format!(
            "GPU {}: {} (UUID: {})\n",
            gpu.index().unwrap_or(0),
            gpu.name().unwrap_or_default(),
            gpu.uuid().unwrap_or_default()
        );
        for (n, mig) in mig_devices(gpu).iter().enumerate() {
            let name = mig.name().unwrap_or_default();
            // "NVIDIA H100 80GB HBM3 MIG 1g.10gb" is listed as "MIG 1g.10gb".
            let profile = name.rsplit_once(" MIG ").map_or(name.as_str(), |(_, p)| p);
            out += &format!(
                "  MIG {profile:<11} Device {n:>2}: (UUID: {})\n",
                mig.uuid().unwrap_or_default()
            );
        }
    }
    out
}

/// The MIG devices NVML lists on `gpu` (none without MIG mode).
fn mig_devices<'n>(gpu: &Device<'n>) -> Vec<Device<'n>> {
    let max = gpu.mig_device_count().unwrap_or(0);
    (0..max)
        .filter_map(|i| gpu.mig_device_by_index(i).ok())
        .collect()
}

/// A `--query-gpu` request.
struct Query {
    fields: Vec<Field>,
    header: bool,
    units: bool,
}

#[derive(Debug, Clone, Copy)]
enum Field {
    Index,
    Uuid,
    Name,
    MemoryTotal,
    PciBusId,
    MigModeCurrent,
}

impl Field {
    fn parse(name: &str) -> Option<Field> {
        Some(match name {
            "index" => Field::Index,
            "uuid" => Field::Uuid,
            "name" => Field::Name,
            "memory.total" => Field::MemoryTotal,
            "pci.bus_id" => Field::PciBusId,
            "mig.mode.current" => Field::MigModeCurrent,
            _ => return None,
        })
    }

    /// The CSV header entry; units stay in it even with `nounits`.
    fn header(self) -> &'static str {
        match self {
            Field::Index => "index",
            Field::Uuid => "uuid",
            Field::Name => "name",
            Field::MemoryTotal => "memory.total [MiB]",
            Field::PciBusId => "pci.bus_id",
            Field::MigModeCurrent => "mig.mode.current",
        }
    }

    fn value(self, gpu: &Device, units: bool) -> String {
        let shown = match self {
            Field::Index => gpu.index().map(|i| i.to_string()),
            Field::Uuid => gpu.uuid(),
            Field::Name => gpu.name(),
            Field::MemoryTotal => gpu.memory_info().map(|m| {
                let mib = m.total / (1024 * 1024);
                if units {
                    format!("{mib} MiB")
                } else {
                    mib.to_string()
                }
            }),
            Field::PciBusId => gpu.pci_info().map(|p| p.bus_id),
            Field::MigModeCurrent => gpu.mig_mode().map(|m| {
                if m.current == 1 {
                    "Enabled".to_string()
                } else {
                    "Disabled".to_string()
                }
            }),
        };
        shown.unwrap_or_else(|e| not_shown(&e).to_string())
    }
}

/// How the real tool shows a value it could not read.
fn not_shown(e: &NvmlError) -> &'static str {
    match e {
        NvmlError::NotSupported => "[N/A]",
        NvmlError::NoPermission => "[Insufficient Permissions]",
        NvmlError::GpuLost => "[GPU is lost]",
        _ => "[Unknown Error]",
    }
}

impl Query {
    fn parse(fields: &str, format: Option<&str>) -> Result<Query, Exit> {
        let format = format
            .ok_or_else(|| Exit(format!("\"--format=\" switch is missing. {HELP_HINT}"), 2))?;
        let (mut csv, mut header, mut units) = (false, true, true);
        for option in format.split(',').map(str::trim) {
            match option {
                "csv" => csv = true,
                "noheader" => header = false,
                "nounits" => units = false,
                _ => return Err(invalid_combination()),
            }
        }
        if !csv {
            return Err(invalid_combination());
        }
        let fields = fields
            .split(',')
            .map(str::trim)
            .map(|f| {
                Field::parse(f)
                    .ok_or_else(|| Exit(format!("Field \"{f}\" is not a valid field to query."), 2))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Query {
            fields,
            header,
            units,
        })
    }

    fn render(&self, gpus: &[Device]) -> String {
        let mut out = String::new();
        if self.header {
            let names: Vec<&str> = self.fields.iter().map(|f| f.header()).collect();
            out += &names.join(", ");
            out.push('\n');
        }
        for gpu in gpus {
            let values: Vec<String> = self
                .fields
                .iter()
                .map(|f| f.value(gpu, self.units))
                .collect();
            out += &values.join(", ");
            out.push('\n');
        }
        out
    }
}

/// `compute-policy`: the GPU's compute time slice.
fn compute_policy(argv: &[String]) -> Result<String, Exit> {
    let (mut list, mut set, mut ids) = (false, None::<String>, None::<String>);
    let mut options = Options::new(argv);
    while let Some(opt) = options.next_option() {
        match opt.flag {
            "-l" | "--list" if opt.inline.is_none() => list = true,
            "--set-timeslice" => set = Some(options.value(&opt)?),
            "-i" | "--id" => ids = Some(options.value(&opt)?),
            _ => return Err(unrecognized(&opt)),
        }
    }
    let level = match (list, set) {
        (true, None) => None,
        (false, Some(v)) => match v.parse::<u32>() {
            Ok(n) if n <= 3 => Some(n),
            _ => {
                return Err(usage_error(&format!(
                    "Invalid timeslice value {v:?}: use 0 (default), 1 (short), 2 (medium) or 3 (long)"
                )));
            }
        },
        _ => return Err(invalid_combination()),
    };
    let nvml = init()?;
    let gpus = select(&nvml, ids.as_deref())?;
    let ops = TimesliceOps::load()?;
    let mut out = String::new();
    for gpu in &gpus {
        let bus = gpu.pci_info().map(|p| p.bus_id).unwrap_or_default();
        // SAFETY: the handle of a live device of the loaded library.
        let handle = unsafe { gpu.handle() };
        match level {
            Some(n) => {
                // SAFETY: the library's own symbol, with its own handle.
                let ret = unsafe { (ops.set)(handle, n) };
                if ret != 0 {
                    return Err(Exit(
                        format!("Failed to set timeslice for GPU {bus}: {}", reason(ret)),
                        exit_code(ret),
                    ));
                }
                out += &format!("Set timeslice to {n} ({}) for GPU {bus}.\n", name(n));
            }
            None => {
                let mut n = 0;
                // SAFETY: as above; `n` is a valid unsigned int.
                let ret = unsafe { (ops.get)(handle, &mut n) };
                if ret != 0 {
                    return Err(Exit(
                        format!("Failed to get timeslice for GPU {bus}: {}", reason(ret)),
                        exit_code(ret),
                    ));
                }
                out += &format!(
                    "GPU {}: {bus}\n    Timeslice                 : {n} ({})\n",
                    gpu.index().unwrap_or(0),
                    name(n)
                );
            }
        }
    }
    Ok(out)
}

fn name(level: u32) -> &'static str {
    match level {
        0 => "Default",
        1 => "Short",
        2 => "Medium",
        _ => "Long",
    }
}

/// NVML return codes as the real tool words them.
fn reason(ret: u32) -> &'static str {
    match ret {
        4 => "Insufficient Permissions",
        3 => "Not Supported",
        2 => "Invalid Argument",
        _ => "Unknown Error",
    }
}

/// The real tool's exit codes: 4 no permission, 3 not supported, 2 bad
/// argument, 15 otherwise.
fn exit_code(ret: u32) -> u8 {
    match ret {
        2..=4 => ret as u8,
        _ => 15,
    }
}

type GetFn = unsafe extern "C" fn(nvml_wrapper_sys::bindings::nvmlDevice_t, *mut u32) -> u32;
type SetFn = unsafe extern "C" fn(nvml_wrapper_sys::bindings::nvmlDevice_t, u32) -> u32;

/// The simulated library's time-slice calls, found in the already loaded
/// `libnvidia-ml.so.1`.
struct TimesliceOps {
    get: GetFn,
    set: SetFn,
}

impl TimesliceOps {
    fn load() -> Result<TimesliceOps, Exit> {
        let unsupported = || {
            Exit(
                "Setting the compute time slice is not supported by the loaded NVML library \
                 (this stand-in needs Tessera's simulated libnvidia-ml)."
                    .to_string(),
                3,
            )
        };
        // SAFETY: RTLD_NOLOAD only finds the library NVML init loaded.
        let lib = unsafe {
            libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
        };
        if lib.is_null() {
            return Err(unsupported());
        }
        // SAFETY: symbols of a loaded library, looked up by name.
        let (get, set) = unsafe {
            (
                libc::dlsym(lib, c"tesseraFakeDeviceGetTimeslice".as_ptr()),
                libc::dlsym(lib, c"tesseraFakeDeviceSetTimeslice".as_ptr()),
            )
        };
        if get.is_null() || set.is_null() {
            return Err(unsupported());
        }
        // SAFETY: the library exports them with these signatures.
        unsafe {
            Ok(TimesliceOps {
                get: std::mem::transmute::<*mut libc::c_void, GetFn>(get),
                set: std::mem::transmute::<*mut libc::c_void, SetFn>(set),
            })
        }
    }
}
