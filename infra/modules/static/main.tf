locals {
  gpu_hosts = { for h in var.hosts : h.name => h if h.gpu_group != null }

  # Sorted so the rendered text (and therefore the terraform_data input) is stable across runs.
  gpu_group_names = sort(keys(var.gpu_groups))
  service_roles   = ["redis", "monitoring", "controlplane"]

  # Connection variables go on a host's first line only (its GPU group, else its first service role):
  # Ansible merges repeated host lines, and one place to read them is easier for operators.
  anchor = {
    for h in var.hosts : h.name => h.gpu_group != null ? h.gpu_group : [for r in local.service_roles : r if contains(h.roles, r)][0]
  }

  host_vars = {
    for h in var.hosts : h.name => join(" ", compact([
      "ansible_host=${h.address}",
      h.ssh_user == null ? "" : "ansible_user=${h.ssh_user}",
      h.ssh_port == null ? "" : "ansible_port=${h.ssh_port}",
    ]))
  }

  group_vars = {
    for name, g in var.gpu_groups : name => [for line in [
      # INI values are strings; quoting a model name with spaces would make the quotes part of it.
      "sarv_gpu_model=${g.gpu_model}",
      "sarv_gpu_count=${g.gpu_count}",
      "sarv_gpu_memory_mib=${g.gpu_memory_mib}",
      "sarv_gpu_interconnect=${g.gpu_interconnect}",
      g.gpus_per_pcie_switch == null ? null : "sarv_gpus_per_pcie_switch=${g.gpus_per_pcie_switch}",
      g.numa_nodes == null ? null : "sarv_numa_nodes=${g.numa_nodes}",
      g.nic == null ? null : "sarv_nic=${g.nic}",
      length(g.labels) == 0 ? null : "sarv_labels=${join(",", [for k in sort(keys(g.labels)) : "${k}=${g.labels[k]}"])}",
    ] : line if line != null]
  }

  group_lines = {
    for name, g in var.gpu_groups : name => concat(local.group_vars[name], [for k in sort(keys(g.extra_vars)) : "${k}=${g.extra_vars[k]}"])
  }

  members = merge(
    { for name in local.gpu_group_names : name => sort([for h in var.hosts : h.name if h.gpu_group == name]) },
    { for role in local.service_roles : role => sort([for h in var.hosts : h.name if contains(h.roles, role)]) },
  )

  inventory_ini = templatefile("${path.module}/templates/inventory.ini.tftpl", {
    gpu_group_names = local.gpu_group_names
    service_roles   = local.service_roles
    members         = local.members
    host_vars       = local.host_vars
    anchor          = local.anchor
    group_vars      = local.group_lines
    gpu_nodes_vars  = var.gpu_nodes_vars
    ansible_user    = var.ansible_user
  })

  # Same content as the INI, in the JSON shape `ansible-inventory --list` prints.
  inventory_data = {
    all = {
      vars     = var.ansible_user == null ? {} : { ansible_user = var.ansible_user }
      children = ["gpu_nodes", "service_nodes"]
    }
    gpu_nodes     = { children = local.gpu_group_names, vars = var.gpu_nodes_vars }
    service_nodes = { children = local.service_roles }
    groups        = local.members
    hosts         = { for h in var.hosts : h.name => { address = h.address, gpu_group = h.gpu_group, roles = h.roles } }
  }
}

# The one resource: it records the rendered inventory in state, so `terraform apply` reports a change
# exactly when the inventory text changes and `terraform output` can hand it to llmctl later.
resource "terraform_data" "this" {
  input = local.inventory_ini

  lifecycle {
    precondition {
      condition     = length([for h in var.hosts : h if contains(h.roles, "monitoring")]) <= 1
      error_message = "at most one host may have the monitoring role (the site playbook runs one Prometheus and Grafana)."
    }
    precondition {
      condition     = length([for name in local.gpu_group_names : name if length(local.members[name]) == 0]) == 0
      error_message = "every gpu_groups entry needs at least one host; remove unused groups."
    }
  }
}
