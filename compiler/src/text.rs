//! The IR text format: a readable, line-per-node form of a whole [`Graph`] that parses back.
//!
//! ```text
//! graph {
//!   dim batch = 8
//!   %0 = input x : f32[batch,64]
//!   %1 = param w1 : f32[64,128] = uniform(-0.125, 0.125, seed=7)
//!   %2 = state adam_m.w1 : f32[64,128] = full(0.0)
//!   %3 = param emb : f32[2,2] = data [0.5, -1.0, 2.0, 0.25]
//!   %4 = constant : i64[3] = [1, 2, 3]
//!   %5 = matmul(%0, %1) : f32[batch,128]
//!   %6 = reduce_sum[axes=1,keep](%5) : f32[batch,1] as row_sums
//!   output logits = %6
//!   update w1 <- %9
//!   guard finite.w1 = %10
//! }
//! ```
//!
//! Grammar, one item per line (blank lines and `#` comments are ignored):
//!
//! - `graph {` opens the graph and `}` closes it; nothing may follow.
//! - `dim NAME = SIZE` declares a named dim and its default size, before the first node
//!   (see [`crate::dims`]).
//! - `%N = input NAME : TYPE` declares the next graph input.
//! - `%N = param NAME : TYPE = INIT [VALUES]` declares the next parameter (trainable), and
//!   `state` instead of `param` declares persistent state that is not trainable. `INIT` is
//!   `full(V)`, `uniform(LOW, HIGH, seed=S)`, `normal(MEAN, STD, seed=S)` or `data` (values given
//!   with the graph); the optional value list holds the parameter's data (trained weights).
//! - `%N = constant [NAME] : TYPE = VALUES` declares the next constant tensor.
//! - `%N = OP(%A, %B, ...) : TYPE [as NAME]` applies an op (its text as in
//!   [`rustytorch_ops::text`]; leaves such as `full[...]` have no parentheses). The type is
//!   checked against the op's inference.
//! - `output NAME = %N`, `update PARAM <- %N` (a parameter's new value after each run) and
//!   `guard NAME = %N` (a bool scalar that must hold for updates to apply).
//!
//! `TYPE` is `dtype[d0,d1,...]` (`f32[]` is a scalar). In inputs and op results a dim may be an
//! expression of named dims, `batch` or `4*batch*seq` (a constant and names joined by `*`):
//! the node's shape at the default sizes is its value, and the expression is what the graph
//! keeps when it runs at other sizes. An op's attributes are written at the default sizes
//! (`reshape[shape=16:512](%4) : f32[batch,512]`). Parameters and constants have fixed types.
//!
//! `NAME` is bare when made of ASCII letters, digits and `_ . - /`, otherwise a double-quoted
//! string with `\\`, `\"`, `\n`, `\r`, `\t` and `\u{..}` escapes. `VALUES` is `[v, v, ...]`, every
//! element in row-major order: floats in their shortest round-trip form (`nan`, `inf`, `-inf`
//! included; f16/bf16 through f32, exactly), integers in decimal, bools as `true`/`false`.
//!
//! Types obey the size limits of [`rustytorch_ops::shape`] (rank at most 64, at most 2^40
//! elements), checked as each type is read, before any value list is counted against it; the
//! parsed graph then passes [`Graph::verify`], the same checks a graph file passes on load.
//!
//! Node labels are any distinct numbers, defined before use; the printer numbers densely in a
//! topological order (inputs, then parameters, then the rest by creation order where dependencies
//! allow), so `print(&parse(&print(g))?) == print(g)`.
//!
//! Values: [`print`] writes every value, so text keeps all data (NaN payloads aside, which are
//! written as `nan`; the binary [`crate::format`] keeps every bit). [`print_elided`] shortens
//! tensors with many elements to `[... N values]` for dumps; such text does not parse back.

use crate::dims::DimExpr;
use crate::{CompileError, Graph, Init, NodeId, Result};
use rustytorch_ops::text::{format_f64, parse_f64, parse_op};
use rustytorch_ops::{bf16, f16, with_data, DType, Data, F64Bits, HostTensor, Op, TensorType};
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write as _;

/// A topological order of every node: inputs and parameters in table order, then the rest in
/// creation order where dependencies allow. The `bool` is false when some nodes could not be
/// ordered (a cycle or a missing operand); those follow in creation order.
pub(crate) fn dense_order(graph: &Graph) -> (Vec<NodeId>, bool) {
    let mut order = Vec::with_capacity(graph.len());
    let mut placed: HashMap<NodeId, ()> = HashMap::new();
    let table = graph
        .inputs
        .iter()
        .map(|d| d.node)
        .chain(graph.params.iter().map(|d| d.node));
    for id in table {
        if graph.node(id).is_ok_and(|n| n.inputs.is_empty()) && placed.insert(id, ()).is_none() {
            order.push(id);
        }
    }
    let mut pending: HashMap<NodeId, usize> = HashMap::new();
    let mut users: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let mut ready = BinaryHeap::new();
    for id in graph.node_ids() {
        if placed.contains_key(&id) {
            continue;
        }
        let mut n = 0;
        for &i in &graph.g[id].inputs {
            if !placed.contains_key(&i) {
                users.entry(i).or_default().push(id);
                n += 1;
            }
        }
        if n == 0 {
            ready.push(std::cmp::Reverse(id));
        } else {
            pending.insert(id, n);
        }
    }
    while let Some(std::cmp::Reverse(id)) = ready.pop() {
        placed.insert(id, ());
        order.push(id);
        for u in users.remove(&id).unwrap_or_default() {
            if let Some(c) = pending.get_mut(&u) {
                *c -= 1;
                if *c == 0 {
                    pending.remove(&u);
                    ready.push(std::cmp::Reverse(u));
                }
            }
        }
    }
    let complete = pending.is_empty();
    if !complete {
        let mut rest: Vec<NodeId> = pending.into_keys().collect();
        rest.sort();
        order.extend(rest);
    }
    (order, complete)
}

/// Prints the whole graph with every value (see the module docs).
pub fn print(graph: &Graph) -> String {
    print_elided(graph, usize::MAX)
}

/// Prints the whole graph, writing tensors of more than `max_values` elements as
/// `[... N values]` (for dumps; such text does not parse back).
pub fn print_elided(graph: &Graph, max_values: usize) -> String {
    let (order, _) = dense_order(graph);
    let dense: HashMap<NodeId, usize> = order.iter().enumerate().map(|(k, &id)| (id, k)).collect();
    let num = |id: NodeId| match dense.get(&id) {
        Some(k) => format!("%{k}"),
        None => format!("%?{}", id.index()),
    };
    let mut out = String::from("graph {\n");
    for d in &graph.dims.named {
        let _ = writeln!(out, "  dim {} = {}", d.name, d.size);
    }
    for &id in &order {
        out.push_str("  ");
        out.push_str(&node_line(graph, id, &num, max_values));
        out.push('\n');
    }
    for (name, id) in &graph.outputs {
        let _ = writeln!(out, "  output {} = {}", name_text(name), num(*id));
    }
    for (p, id) in &graph.updates {
        let name = match graph.params.get(*p as usize) {
            Some(d) => name_text(&d.name),
            None => format!("#{p}"),
        };
        let _ = writeln!(out, "  update {name} <- {}", num(*id));
    }
    for (name, id) in &graph.guards {
        let _ = writeln!(out, "  guard {} = {}", name_text(name), num(*id));
    }
    out.push_str("}\n");
    out
}

/// One node's line, with the graph's own node ids (`%17`) rather than dense numbers; values of
/// tensors over 16 elements are elided.
pub fn print_node(graph: &Graph, id: NodeId) -> String {
    if graph.node(id).is_err() {
        return format!("%{} = <missing node>", id.index());
    }
    node_line(graph, id, &|i: NodeId| format!("%{}", i.index()), 16)
}

fn node_line(
    graph: &Graph,
    id: NodeId,
    num: &dyn Fn(NodeId) -> String,
    max_values: usize,
) -> String {
    let n = &graph.g[id];
    let head = num(id);
    match &n.op {
        Op::Input { index, .. } => {
            if let Some(d) = graph.inputs.get(*index as usize).filter(|d| d.node == id) {
                return format!(
                    "{head} = input {} : {}",
                    name_text(&d.name),
                    graph.sym_type_text(id)
                );
            }
        }
        Op::Param { index, .. } => {
            if let Some(d) = graph.params.get(*index as usize).filter(|d| d.node == id) {
                let kw = if d.trainable { "param" } else { "state" };
                let mut s = format!(
                    "{head} = {kw} {} : {} = {}",
                    name_text(&d.name),
                    n.ty,
                    init_text(&d.init)
                );
                if let Some(t) = &d.data {
                    s.push(' ');
                    s.push_str(&values_text(t, max_values));
                }
                return s;
            }
        }
        Op::Constant { index, .. } => {
            if let Some(t) = graph.constants.get(*index as usize) {
                let name = match &n.name {
                    Some(nm) => format!(" {}", name_text(nm)),
                    None => String::new(),
                };
                return format!(
                    "{head} = constant{name} : {} = {}",
                    n.ty,
                    values_text(t, max_values)
                );
            }
        }
        _ => {}
    }
    let mut s = format!("{head} = {}", n.op);
    if !n.inputs.is_empty() {
        let args: Vec<String> = n.inputs.iter().map(|&i| num(i)).collect();
        let _ = write!(s, "({})", args.join(", "));
    }
    let _ = write!(s, " : {}", graph.sym_type_text(id));
    if let Some(name) = &n.name {
        let _ = write!(s, " as {}", name_text(name));
    }
    s
}

fn init_text(init: &Init) -> String {
    let f = |x: f64| format_f64(F64Bits::new(x));
    match init {
        Init::Full(v) => format!("full({})", f(*v)),
        Init::Uniform { low, high, seed } => {
            format!("uniform({}, {}, seed={seed})", f(*low), f(*high))
        }
        Init::Normal { mean, std, seed } => {
            format!("normal({}, {}, seed={seed})", f(*mean), f(*std))
        }
        Init::Data => "data".to_string(),
    }
}

fn is_bare(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'))
}

/// A name as written in IR text: bare, or quoted with escapes.
fn name_text(s: &str) -> String {
    if is_bare(s) {
        return s.to_string();
    }
    let mut q = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            '\r' => q.push_str("\\r"),
            '\t' => q.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(q, "\\u{{{:x}}}", c as u32);
            }
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

fn float_text(x: f64, dbg: String) -> String {
    if x.is_nan() {
        "nan".into()
    } else {
        dbg
    }
}

fn values_text(t: &HostTensor, max_values: usize) -> String {
    if t.numel() > max_values {
        return format!("[... {} values]", t.numel());
    }
    let parts: Vec<String> = match t.data() {
        Data::F32(v) => v
            .iter()
            .map(|x| float_text(*x as f64, format!("{x:?}")))
            .collect(),
        Data::F64(v) => v.iter().map(|x| float_text(*x, format!("{x:?}"))).collect(),
        Data::F16(v) => v
            .iter()
            .map(|x| float_text(x.to_f64(), format!("{:?}", x.to_f32())))
            .collect(),
        Data::BF16(v) => v
            .iter()
            .map(|x| float_text(x.to_f64(), format!("{:?}", x.to_f32())))
            .collect(),
        other => with_data!(other, v => v.iter().map(|x| x.to_string()).collect()),
    };
    format!("[{}]", parts.join(", "))
}

// ---------------------------------------------------------------- parsing

/// Parses IR text into a verified graph; errors are [`CompileError::Parse`] with the 1-based line.
pub fn parse(text: &str) -> Result<Graph> {
    let mut p = Parser {
        graph: Graph::new(),
        labels: HashMap::new(),
    };
    let mut state = 0; // 0: before `graph {`, 1: inside, 2: after `}`
    let mut close_line = 0;
    let mut last = 0;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        last = line;
        let mut lx = Lexer::new(raw);
        if lx.at_end() {
            continue;
        }
        let err = |reason: String| CompileError::Parse { line, reason };
        match state {
            0 => {
                lx.keyword("graph").map_err(err)?;
                lx.punct("{").map_err(err)?;
                lx.end().map_err(err)?;
                state = 1;
            }
            1 => {
                if lx.eat("}") {
                    lx.end().map_err(err)?;
                    state = 2;
                    close_line = line;
                } else {
                    // Inference belongs to the op families; a panic there on hostile attributes
                    // must still surface as an error of this line (the parser is dropped).
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.line(&mut lx)))
                        .unwrap_or_else(|_| {
                            Err("an op's shape inference failed on this line's attributes".into())
                        })
                        .map_err(err)?;
                }
            }
            _ => return Err(err("text after the closing `}`".into())),
        }
    }
    match state {
        0 => Err(CompileError::Parse {
            line: last.max(1),
            reason: "expected `graph {`".into(),
        }),
        1 => Err(CompileError::Parse {
            line: last,
            reason: "missing the closing `}`".into(),
        }),
        _ => {
            p.graph.verify().map_err(|e| CompileError::Parse {
                line: close_line,
                reason: e.to_string(),
            })?;
            Ok(p.graph)
        }
    }
}

type PResult<T> = std::result::Result<T, String>;

struct Parser {
    graph: Graph,
    labels: HashMap<u64, NodeId>,
}

impl Parser {
    fn line(&mut self, lx: &mut Lexer<'_>) -> PResult<()> {
        if lx.peek() == Some('%') {
            return self.node(lx);
        }
        let kw = lx.word()?;
        match kw {
            "dim" => {
                let name = lx.word()?;
                lx.punct("=")?;
                let size = lx.word()?;
                lx.end()?;
                let size = size
                    .parse::<usize>()
                    .map_err(|_| format!("dim `{name}`: bad size `{size}`"))?;
                if self.graph.dims.size(name).is_some() {
                    return Err(format!("dim `{name}` is declared twice"));
                }
                if !self.graph.is_empty() {
                    return Err(format!(
                        "dim `{name}`: declare named dims before the first node"
                    ));
                }
                self.graph
                    .declare_dim(name, size)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            "output" => {
                let name = lx.name()?;
                lx.punct("=")?;
                let id = self.label_use(lx)?;
                lx.end()?;
                self.graph.add_output(&name, id).map_err(|e| e.to_string())
            }
            "update" => {
                let name = lx.name()?;
                lx.punct("<-")?;
                let id = self.label_use(lx)?;
                lx.end()?;
                let p = self
                    .graph
                    .params
                    .iter()
                    .position(|d| d.name == name)
                    .ok_or_else(|| format!("update of unknown parameter `{name}`"))?;
                self.graph.updates.push((p as u32, id));
                Ok(())
            }
            "guard" => {
                let name = lx.name()?;
                lx.punct("=")?;
                let id = self.label_use(lx)?;
                lx.end()?;
                self.graph.guards.push((name, id));
                Ok(())
            }
            other => Err(format!(
                "expected a node (`%N = ...`), `dim`, `output`, `update`, `guard` or `}}`, found \
                 `{other}`"
            )),
        }
    }

    fn label_use(&self, lx: &mut Lexer<'_>) -> PResult<NodeId> {
        let l = lx.label()?;
        self.labels
            .get(&l)
            .copied()
            .ok_or_else(|| format!("%{l} is not defined above"))
    }

    fn node(&mut self, lx: &mut Lexer<'_>) -> PResult<()> {
        let label = lx.label()?;
        if self.labels.contains_key(&label) {
            return Err(format!("%{label} is defined twice"));
        }
        lx.punct("=")?;
        let op_text = lx.op_token()?;
        let id = match op_text {
            "input" => {
                let name = lx.name()?;
                lx.punct(":")?;
                let (dtype, dims) = lx.sym_ty(&self.graph)?;
                lx.end()?;
                self.graph
                    .add_input_dims(&name, dtype, &dims)
                    .map_err(|e| e.to_string())?
            }
            "param" | "state" => {
                let name = lx.name()?;
                lx.punct(":")?;
                let ty = lx.ty()?;
                lx.punct("=")?;
                let init = lx.init()?;
                let data = if lx.peek() == Some('[') {
                    Some(lx.values(&ty)?)
                } else {
                    None
                };
                lx.end()?;
                let id = self
                    .graph
                    .add_param(&name, ty, init, op_text == "param")
                    .map_err(|e| e.to_string())?;
                if let Some(last) = self.graph.params.last_mut() {
                    last.data = data;
                }
                id
            }
            "constant" => {
                let name = if lx.peek() == Some(':') {
                    None
                } else {
                    Some(lx.name()?)
                };
                lx.punct(":")?;
                let ty = lx.ty()?;
                lx.punct("=")?;
                let t = lx.values(&ty)?;
                lx.end()?;
                let id = self.graph.add_constant(t);
                if let Some(n) = self.graph.node_mut(id) {
                    n.name = name;
                }
                id
            }
            text => {
                let op = parse_op(text).map_err(|e| e.to_string())?;
                if matches!(
                    op,
                    Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }
                ) {
                    return Err(format!(
                        "`{text}`: write inputs, parameters and constants as declarations \
                         (`input NAME : TYPE` ...)"
                    ));
                }
                let mut args = Vec::new();
                if lx.eat("(") && !lx.eat(")") {
                    loop {
                        args.push(self.label_use(lx)?);
                        if lx.eat(")") {
                            break;
                        }
                        lx.punct(",")?;
                    }
                }
                lx.punct(":")?;
                let (dtype, dims) = lx.sym_ty(&self.graph)?;
                let name = if lx.eat_word("as") {
                    Some(lx.name()?)
                } else {
                    None
                };
                lx.end()?;
                let id = self.graph.add(op, &args).map_err(|e| e.to_string())?;
                let inferred = self.graph.ty(id);
                let ty = TensorType::new(
                    dtype,
                    self.graph.eval_dims(&dims).map_err(|e| e.to_string())?,
                );
                if *inferred != ty {
                    return Err(format!(
                        "the type is written {} but the op infers {inferred}",
                        crate::dims::type_text(dtype, &dims)
                    ));
                }
                self.graph
                    .set_sym_shape(id, dims)
                    .map_err(|e| e.to_string())?;
                if let Some(n) = self.graph.node_mut(id) {
                    n.name = name;
                }
                id
            }
        };
        self.labels.insert(label, id);
        Ok(())
    }
}

/// A cursor over one line.
struct Lexer<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Lexer<'a> {
    fn new(s: &'a str) -> Lexer<'a> {
        Lexer { s, pos: 0 }
    }

    fn skip_ws(&mut self) {
        let rest = &self.s[self.pos..];
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn rest(&mut self) -> &'a str {
        self.skip_ws();
        &self.s[self.pos..]
    }

    fn peek(&mut self) -> Option<char> {
        self.rest().chars().next()
    }

    fn at_end(&mut self) -> bool {
        matches!(self.peek(), None | Some('#'))
    }

    fn end(&mut self) -> PResult<()> {
        if self.at_end() {
            Ok(())
        } else {
            Err(format!(
                "unexpected `{}` at the end of the line",
                self.rest().trim_end()
            ))
        }
    }

    fn eat(&mut self, p: &str) -> bool {
        if self.rest().starts_with(p) {
            self.pos += p.len();
            true
        } else {
            false
        }
    }

    fn punct(&mut self, p: &str) -> PResult<()> {
        if self.eat(p) {
            Ok(())
        } else {
            Err(format!("expected `{p}`, found {}", self.found()))
        }
    }

    fn found(&mut self) -> String {
        let r = self.rest();
        if r.is_empty() {
            "the end of the line".into()
        } else {
            let w: String = r.chars().take(20).collect();
            format!("`{w}`")
        }
    }

    /// A run of `[A-Za-z0-9_]`.
    fn word(&mut self) -> PResult<&'a str> {
        let r = self.rest();
        let n = r
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(r.len());
        if n == 0 {
            return Err(format!("expected a word, found {}", self.found()));
        }
        self.pos += n;
        Ok(&r[..n])
    }

    fn keyword(&mut self, k: &str) -> PResult<()> {
        let save = self.pos;
        match self.word() {
            Ok(w) if w == k => Ok(()),
            _ => {
                self.pos = save;
                Err(format!("expected `{k}`, found {}", self.found()))
            }
        }
    }

    fn eat_word(&mut self, k: &str) -> bool {
        let save = self.pos;
        match self.word() {
            Ok(w) if w == k => true,
            _ => {
                self.pos = save;
                false
            }
        }
    }

    fn label(&mut self) -> PResult<u64> {
        self.punct("%")?;
        let r = &self.s[self.pos..];
        let n = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
        let v = r[..n].parse::<u64>().map_err(|_| {
            let w: String = r.chars().take(n.max(1)).collect();
            format!("expected a node label `%N`, found `%{w}`")
        })?;
        self.pos += n;
        Ok(v)
    }

    /// An op's text: up to whitespace or `(` outside brackets.
    fn op_token(&mut self) -> PResult<&'a str> {
        let r = self.rest();
        let mut depth = 0usize;
        let mut n = r.len();
        for (i, c) in r.char_indices() {
            match c {
                '[' => depth += 1,
                ']' => depth = depth.saturating_sub(1),
                '(' if depth == 0 => {
                    n = i;
                    break;
                }
                c if c.is_whitespace() && depth == 0 => {
                    n = i;
                    break;
                }
                _ => {}
            }
        }
        if n == 0 {
            return Err(format!("expected an op, found {}", self.found()));
        }
        self.pos += n;
        Ok(&r[..n])
    }

    fn name(&mut self) -> PResult<String> {
        let r = self.rest();
        if let Some(body) = r.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = body.char_indices();
            while let Some((i, c)) = chars.next() {
                match c {
                    '"' => {
                        self.pos += 1 + i + 1;
                        return Ok(out);
                    }
                    '\\' => match chars.next() {
                        Some((_, '"')) => out.push('"'),
                        Some((_, '\\')) => out.push('\\'),
                        Some((_, 'n')) => out.push('\n'),
                        Some((_, 'r')) => out.push('\r'),
                        Some((_, 't')) => out.push('\t'),
                        Some((j, 'u')) => {
                            let tail = &body[j + 1..];
                            let close = tail
                                .strip_prefix('{')
                                .and_then(|t| t.find('}'))
                                .ok_or("bad `\\u{..}` escape")?;
                            let code = u32::from_str_radix(&tail[1..close + 1], 16)
                                .ok()
                                .and_then(char::from_u32)
                                .ok_or("bad `\\u{..}` escape")?;
                            out.push(code);
                            for _ in 0..close + 2 {
                                chars.next();
                            }
                        }
                        _ => return Err("bad escape in a quoted name".into()),
                    },
                    c => out.push(c),
                }
            }
            return Err("unterminated quoted name".into());
        }
        let n = r
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/')))
            .unwrap_or(r.len());
        if n == 0 {
            return Err(format!("expected a name, found {}", self.found()));
        }
        self.pos += n;
        Ok(r[..n].to_string())
    }

    /// `dtype[d0,d1,...]`.
    /// A type whose dims may be expressions of the graph's named dims (`f32[batch,512]`):
    /// its dtype and dims. The dims at the default sizes obey the size limits.
    fn sym_ty(&mut self, graph: &Graph) -> PResult<(DType, Vec<DimExpr>)> {
        let w = self.word()?;
        let dtype = DType::from_name(w).ok_or_else(|| format!("unknown dtype `{w}`"))?;
        self.punct("[")?;
        let mut dims = Vec::new();
        if !self.eat("]") {
            loop {
                let r = self.rest();
                let n = r
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '*'))
                    .unwrap_or(r.len());
                let d = &r[..n];
                self.pos += n;
                let e = DimExpr::parse(d)?;
                if let Some(u) = e.names().iter().find(|u| graph.dims.size(u).is_none()) {
                    return Err(format!(
                        "unknown named dim `{u}` (declare it with `dim {u} = SIZE` first)"
                    ));
                }
                dims.push(e);
                if self.eat("]") {
                    break;
                }
                self.punct(",")?;
            }
        }
        let shape = graph.eval_dims(&dims).map_err(|e| e.to_string())?;
        shape
            .check_limits()
            .map_err(|e| format!("type {dtype}: {e}"))?;
        Ok((dtype, dims))
    }

    fn ty(&mut self) -> PResult<TensorType> {
        let w = self.word()?;
        let dtype = DType::from_name(w).ok_or_else(|| format!("unknown dtype `{w}`"))?;
        self.punct("[")?;
        let mut dims = Vec::new();
        if !self.eat("]") {
            loop {
                let d = self.word()?;
                dims.push(
                    d.parse::<usize>()
                        .map_err(|_| format!("bad dimension `{d}`"))?,
                );
                if self.eat("]") {
                    break;
                }
                self.punct(",")?;
            }
        }
        let ty = TensorType::new(dtype, dims);
        ty.shape
            .check_limits()
            .map_err(|e| format!("type {dtype}: {e}"))?;
        Ok(ty)
    }

    /// A number token: up to `,`, `)`, `]` or whitespace.
    fn number(&mut self) -> PResult<&'a str> {
        let r = self.rest();
        let n = r
            .find(|c: char| matches!(c, ',' | ')' | ']') || c.is_whitespace())
            .unwrap_or(r.len());
        if n == 0 {
            return Err(format!("expected a number, found {}", self.found()));
        }
        self.pos += n;
        Ok(&r[..n])
    }

    fn float(&mut self) -> PResult<f64> {
        let t = self.number()?;
        parse_f64(t)
            .map(F64Bits::get)
            .ok_or_else(|| format!("`{t}` is not a float"))
    }

    fn init(&mut self) -> PResult<Init> {
        let kind = self.word()?;
        if kind == "data" {
            return Ok(Init::Data);
        }
        self.punct("(")?;
        let init = match kind {
            "full" => Init::Full(self.float()?),
            "uniform" | "normal" => {
                let a = self.float()?;
                self.punct(",")?;
                let b = self.float()?;
                self.punct(",")?;
                self.keyword("seed")?;
                self.punct("=")?;
                let s = self.number()?;
                let seed = s.parse::<u64>().map_err(|_| format!("bad seed `{s}`"))?;
                if kind == "uniform" {
                    Init::Uniform {
                        low: a,
                        high: b,
                        seed,
                    }
                } else {
                    Init::Normal {
                        mean: a,
                        std: b,
                        seed,
                    }
                }
            }
            other => return Err(format!("unknown initializer `{other}`")),
        };
        self.punct(")")?;
        Ok(init)
    }

    /// `[v, v, ...]` holding exactly the elements of `ty`.
    fn values(&mut self, ty: &TensorType) -> PResult<HostTensor> {
        self.punct("[")?;
        if self.rest().starts_with("...") {
            return Err("tensor values were elided when this text was printed".into());
        }
        let mut toks = Vec::new();
        if !self.eat("]") {
            loop {
                toks.push(self.number()?);
                if self.eat("]") {
                    break;
                }
                self.punct(",")?;
            }
        }
        let want = ty.shape.numel();
        if toks.len() != want {
            return Err(format!(
                "{ty} needs {want} values, {} are given",
                toks.len()
            ));
        }
        fn all<T>(toks: &[&str], what: &str, f: impl Fn(&str) -> Option<T>) -> PResult<Vec<T>> {
            toks.iter()
                .map(|t| f(t).ok_or_else(|| format!("`{t}` is not {what}")))
                .collect()
        }
        let fl = |t: &str| parse_f64(t).map(F64Bits::get);
        let data = match ty.dtype {
            DType::F32 => Data::F32(all(&toks, "an f32", |t| fl(t).map(|x| x as f32))?.into()),
            DType::F64 => Data::F64(all(&toks, "an f64", fl)?.into()),
            DType::F16 => {
                Data::F16(all(&toks, "an f16", |t| fl(t).map(|x| f16::from_f32(x as f32)))?.into())
            }
            DType::BF16 => Data::BF16(
                all(&toks, "a bf16", |t| fl(t).map(|x| bf16::from_f32(x as f32)))?.into(),
            ),
            DType::I32 => Data::I32(all(&toks, "an i32", |t| t.parse().ok())?.into()),
            DType::I64 => Data::I64(all(&toks, "an i64", |t| t.parse().ok())?.into()),
            DType::U8 => Data::U8(all(&toks, "a u8", |t| t.parse().ok())?.into()),
            DType::I8 => Data::I8(all(&toks, "an i8", |t| t.parse().ok())?.into()),
            DType::I16 => Data::I16(all(&toks, "an i16", |t| t.parse().ok())?.into()),
            DType::U16 => Data::U16(all(&toks, "a u16", |t| t.parse().ok())?.into()),
            DType::U32 => Data::U32(all(&toks, "a u32", |t| t.parse().ok())?.into()),
            DType::U64 => Data::U64(all(&toks, "a u64", |t| t.parse().ok())?.into()),
            DType::Bool => Data::Bool(
                all(&toks, "true or false", |t| match t {
                    "true" => Some(true),
                    "false" => Some(false),
                    _ => None,
                })?
                .into(),
            ),
        };
        HostTensor::from_data(data, ty.shape.clone()).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_quote_and_unquote() {
        for s in [
            "w1",
            "adam_m.w1",
            "a b",
            "q\"x\\y",
            "tab\there",
            "nl\n",
            "bell\u{7}",
            "ünï",
            "",
        ] {
            let t = name_text(s);
            let mut lx = Lexer::new(&t);
            assert_eq!(lx.name().unwrap(), s, "{t}");
            assert!(lx.at_end());
        }
    }

    #[test]
    fn float_values_round_trip_bit_for_bit() {
        let vals = [
            0.1f32,
            -0.0,
            1e-45,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0,
        ];
        let t = HostTensor::from_vec(vals.to_vec(), [7]).unwrap();
        let text = values_text(&t, usize::MAX);
        let back = Lexer::new(&text).values(&t.ty()).unwrap();
        let a: Vec<u32> = vals.iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> = back
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(a, b);
    }
}
